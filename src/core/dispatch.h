// Runtime dtype / index type -> compile-time types, shared by the backends.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include "core/numeric.h"
#include "fusedloss/types.h"

namespace fusedloss::core {

template <class F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(std::integral_constant<StorageKind, StorageKind::F32>{}); return;
    case DType::F16: f(std::integral_constant<StorageKind, StorageKind::F16>{}); return;
    case DType::BF16: f(std::integral_constant<StorageKind, StorageKind::BF16>{}); return;
    default: break;
  }
  throw Error(std::string("dtype: got ") + to_string(dtype) + ", expected fp32, fp16 or bf16");
}

template <class F>
void dispatch_index(IndexType type, F&& f) {
  switch (type) {
    case IndexType::I32: f(int32_t{}); return;
    case IndexType::I64: f(int64_t{}); return;
  }
  throw Error("target.type: unknown value " + std::to_string(int(type)));
}

}  // namespace fusedloss::core
