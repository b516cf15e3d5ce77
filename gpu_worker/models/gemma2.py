"""Gemma 2: the Gemma decoder (gemma.py) with attention logits soft-capping
(attn_logit_softcapping, 50 by default), the final logits soft-capped (final_logit_softcapping,
30), sliding-window layers alternating with full ones from a sliding one (layer_types), and one
rotary embedding for every layer."""

from __future__ import annotations

from gpu_worker.models.gemma import GemmaForCausalLM


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 is the shared Gemma decoder as its config.json sets it (config/gemma_arch.py)."""
