"""One-line Megatron-core patch: fusedloss cross-entropy, SwiGLU, RMSNorm and (asked for) the
linear cross-entropy head inside Megatron.

    from fusedloss.megatron import apply_fusedloss_to_megatron
    apply_fusedloss_to_megatron()          # before building the model (its norms are built
                                           # then); the same arguments on every rank

What is replaced is the object each public Megatron function resolves at call time, so every
consumer sees the patch whatever its import order (language_module.py, mlp.py, moe/*.py import
the functions by name):

  megatron.core.fusions.fused_cross_entropy._VocabParallelCrossEntropy   (fused 'native' CE)
  megatron.core.tensor_parallel.cross_entropy._VocabParallelCrossEntropy (unfused CE)
  megatron.core.fusions.fused_bias_swiglu.{SwiGLUFunction, BiasSwiGLUFunction,
                                           WeightedSwiGLUFunction}
  megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__  (the local spec's norm, for
      normalization="RMSNorm"; TransformerEngine's spec is left alone)
  megatron.core.models.common.language_module.language_module.LanguageModule.
      compute_language_model_loss  (the 'te' and 'liger' cross-entropy routes)
  megatron.core.models.gpt.gpt_model.GPTModel._postprocess  (linear_cross_entropy=True: the
      output layer and the loss as one op, where labels are given)

Scope: tensor_model_parallel_size == 1. With TP > 1 the patch raises RuntimeError, at patch time
(parallel_state) and at call time (the tp_group Megatron passes), unless allow_vocab_parallel=True,
which runs the experimental vocab-parallel path (one all-gather per forward).
"""
from .patch import apply_fusedloss_to_megatron, fusedloss_megatron, is_patched, unpatch_megatron
from .modules import FusedLossRMSNorm, FusedLossSwiGLU, fused_language_model_loss

__all__ = ["apply_fusedloss_to_megatron", "unpatch_megatron", "fusedloss_megatron", "is_patched",
           "FusedLossSwiGLU", "FusedLossRMSNorm", "fused_language_model_loss"]
