"""Single-device model code: the Mixtral-family decoder, its MoE block, and HF checkpoint interop."""

from moebal.interop.hf import from_hf, hf_to_moebal, to_hf
from moebal.models.transformer import CausalLMOutput, MoebalForCausalLM, build_model

__all__ = ["CausalLMOutput", "MoebalForCausalLM", "build_model", "from_hf", "hf_to_moebal", "to_hf"]
