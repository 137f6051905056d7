# A downstream project that only knows find_package(fusedloss), configured, built and run
# against an installed fusedloss. MODE:
#   install   (default) cmake --install FUSEDLOSS_BUILD into a scratch prefix; the consumer
#             requires exactly the components that build has, and requiring one it lacks fails;
#             then the same consumer against the build tree itself (fusedloss_DIR); then, with
#             the CUDA toolkit and NCCL hidden, COMPONENTS CPU builds and runs, and (a build
#             with CUDA) no components fails saying what to install
#   cpu_only  configure, build and install a CPU-only fusedloss (no CUDA, NCCL, MPI) from
#             FUSEDLOSS_SOURCE; the consumer configures with CUDA, NCCL and MPI hidden
#   prefix    an existing install: PREFIXES is a list of CMAKE_PREFIX_PATH values to try each
#             (the wheel: python -m fusedloss --cmake-prefix-path and --cmake-dir), then the
#             CPU component and the missing toolkit's message as in install (HAS_CUDA: whether
#             that install has CUDA)
# EXPECT_VERSION, when given: the version find_package and FUSEDLOSS_VERSION must report.
cmake_minimum_required(VERSION 3.24)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
# Configure, build and run the consumer against `prefix` (extra configure arguments follow).
function(consume name prefix)
  set(dir ${BUILD_ROOT}/${name})
  file(REMOVE_RECURSE ${dir})
  run(${CMAKE_COMMAND} -E env ${CONSUMER_ENV} ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${dir}
      -DCMAKE_PREFIX_PATH=${prefix} -DEXPECT_VERSION=${EXPECT_VERSION} ${ARGN})
  run(${CMAKE_COMMAND} --build ${dir})
  run(${dir}/consumer)
endfunction()
# Requiring `component` must fail at configure time, saying the build lacks it.
function(expect_missing_component name prefix component)
  set(dir ${BUILD_ROOT}/${name})
  file(REMOVE_RECURSE ${dir})
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${CONSUMER_ENV} ${CMAKE_COMMAND} -S ${SOURCE_DIR}
      -B ${dir} -DCMAKE_PREFIX_PATH=${prefix} -DFUSEDLOSS_COMPONENTS=${component} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  # CMake wraps a message's lines where the paths in it make them long: match the text flat
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}${err}")
  if(rc EQUAL 0 OR NOT flat MATCHES "built without ${component}")
    message(FATAL_ERROR "COMPONENTS ${component} should fail with \"built without ${component}\""
                        " (exit ${rc}):\n${out}${err}")
  endif()
  message(STATUS "COMPONENTS ${component} refused as expected")
endfunction()

# A configure that must fail with `expected` (a regular expression) in its output.
function(expect_failure name prefix expected)
  set(dir ${BUILD_ROOT}/${name})
  file(REMOVE_RECURSE ${dir})
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${CONSUMER_ENV} ${CMAKE_COMMAND} -S ${SOURCE_DIR}
      -B ${dir} -DCMAKE_PREFIX_PATH=${prefix} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}${err}")  # CMake wraps its messages
  if(rc EQUAL 0 OR NOT flat MATCHES "${expected}")
    message(FATAL_ERROR "${name}: the configure should fail with \"${expected}\" (exit ${rc}):\n${out}${err}")
  endif()
  message(STATUS "${name}: refused as expected")
endfunction()
# CONSUMER_ENV and HIDE_CUDA: neither nvcc nor the CUDA toolkit nor NCCL visible to the consumer.
macro(hide_cuda)
  string(REPLACE ":" ";" dirs "$ENV{PATH}")
  set(path "")
  foreach(dir IN LISTS dirs)
    if(NOT EXISTS ${dir}/nvcc AND NOT dir MATCHES "cuda")
      list(APPEND path ${dir})
    endif()
  endforeach()
  string(REPLACE ";" ":" path "${path}")
  set(CONSUMER_ENV --unset=CUDACXX --unset=CUDA_HOME --unset=CUDA_PATH --unset=CUDAToolkit_ROOT
      "PATH=${path}")
  set(HIDE_CUDA -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_DISABLE_FIND_PACKAGE_NCCL=ON)
endmacro()
# A program that uses the CPU backend alone, without the CUDA toolkit: COMPONENTS CPU works;
# a build with CUDA asked for everything says what to install.
function(cpu_component prefix has_cuda)
  hide_cuda()
  consume(consumer-cpu-component "${prefix}" -DFUSEDLOSS_COMPONENTS=CPU ${HIDE_CUDA} ${ARGN})
  if(has_cuda)
    expect_failure(consumer-no-cuda-toolkit "${prefix}"
      "was built with CUDA.*needs the CUDA toolkit.*COMPONENTS CPU" ${HIDE_CUDA} ${ARGN})
  endif()
endfunction()

if(NOT MODE)
  set(MODE install)
endif()
file(MAKE_DIRECTORY ${BUILD_ROOT})
if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${BUILD_ROOT}/prefix)
  run(${CMAKE_COMMAND} --install ${FUSEDLOSS_BUILD} --prefix ${BUILD_ROOT}/prefix)
  # HAS_COMPONENTS: what that build has, comma-separated (e.g. CUDA,NCCL,MPI)
  consume(consumer ${BUILD_ROOT}/prefix -DFUSEDLOSS_COMPONENTS=${HAS_COMPONENTS})
  consume(consumer-build-tree "" -Dfusedloss_DIR=${FUSEDLOSS_BUILD}
          -DFUSEDLOSS_COMPONENTS=${HAS_COMPONENTS})
  string(REPLACE "," ";" has "${HAS_COMPONENTS}")
  foreach(component CUDA NCCL MPI)
    if(NOT component IN_LIST has)
      expect_missing_component(consumer-${component} ${BUILD_ROOT}/prefix ${component})
    endif()
  endforeach()
  if("CUDA" IN_LIST has)
    cpu_component(${BUILD_ROOT}/prefix TRUE)
  else()
    cpu_component(${BUILD_ROOT}/prefix FALSE)
  endif()
elseif(MODE STREQUAL "cpu_only")
  # Neither nvcc nor MPI visible to the library build or the consumer.
  hide_cuda()
  set(hide ${HIDE_CUDA} -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  file(REMOVE_RECURSE ${BUILD_ROOT}/lib-build ${BUILD_ROOT}/prefix)
  run(${CMAKE_COMMAND} -E env ${CONSUMER_ENV} ${CMAKE_COMMAND} -S ${FUSEDLOSS_SOURCE}
      -B ${BUILD_ROOT}/lib-build -G ${GENERATOR} -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release
      -DFUSEDLOSS_CUDA=OFF -DFUSEDLOSS_NCCL=OFF -DFUSEDLOSS_MPI=OFF -DFUSEDLOSS_TESTS=OFF
      -DFUSEDLOSS_EXAMPLES=OFF -DFUSEDLOSS_BENCH=OFF ${hide})
  run(${CMAKE_COMMAND} --build ${BUILD_ROOT}/lib-build)
  run(${CMAKE_COMMAND} --install ${BUILD_ROOT}/lib-build --prefix ${BUILD_ROOT}/prefix)
  list(APPEND hide -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
  consume(consumer ${BUILD_ROOT}/prefix ${hide})
  consume(consumer-cpu-component ${BUILD_ROOT}/prefix -DFUSEDLOSS_COMPONENTS=CPU ${hide})
  expect_missing_component(consumer-cuda ${BUILD_ROOT}/prefix CUDA ${hide})
  expect_missing_component(consumer-mpi ${BUILD_ROOT}/prefix MPI ${hide})
elseif(MODE STREQUAL "prefix")
  set(i 0)
  foreach(prefix IN LISTS PREFIXES)
    math(EXPR i "${i} + 1")
    consume(consumer-${i} ${prefix})
  endforeach()
  list(GET PREFIXES 0 first)
  cpu_component(${first} "${HAS_CUDA}")
else()
  message(FATAL_ERROR "MODE ${MODE}: install, cpu_only or prefix")
endif()
