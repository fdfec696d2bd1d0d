"""Single-device model code: the Mixtral-family decoder and its MoE block."""

from moebal.models.transformer import CausalLMOutput, MoebalForCausalLM, build_model

__all__ = ["CausalLMOutput", "MoebalForCausalLM", "build_model"]
