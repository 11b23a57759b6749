"""
A trained cell as a Hugging Face causal language model: export.py copies this file and model.py
beside the cell's weights (model.safetensors), config.json and tokenizer, and then

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

builds model.GPT from the cell's GPTConfig (config.json's "gpt") and loads its weights: the logits
are GPT's, for every scheme, dense or MoE. Transformers copies model.py along (a relative import),
so DIR needs nothing from this repository. This file is not imported by the project itself.
"""

import torch
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .model import GPT, GPTConfig, rotary_tables


class NanodepthConfig(PretrainedConfig):
    model_type = "nanodepth"

    def __init__(self, gpt=None, **kwargs):
        self.gpt = dict(gpt or {})  # GPTConfig's fields, as the cell recorded them
        # where tools look for the longest sequence (lm-evaluation-harness's max_length): GPT's block_size
        self.max_position_embeddings = self.gpt.get("block_size", GPTConfig.block_size)
        kwargs.setdefault("tie_word_embeddings", False)  # GPT ties them itself; the file holds both names
        super().__init__(**kwargs)


class NanodepthForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanodepthConfig
    base_model_prefix = "gpt"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(GPTConfig(**config.gpt))
        self.post_init()  # transformers' bookkeeping (which weights are tied: none it must tie)

    @torch.no_grad()
    def _init_weights(self, module):
        """Every weight comes from model.safetensors; what it does not hold, GPT's rotary tables (buffers
        it computes), is computed again here (transformers builds the model on the meta device)."""
        if hasattr(module, "rotary_cos"):
            cos, sin = rotary_tables(
                module.rotary_cos.size(-1), self.config.gpt.get("block_size", GPTConfig.block_size)
            )
            module.rotary_cos.copy_(cos)
            module.rotary_sin.copy_(sin)

    def generate(self, *args, **kwargs):
        """transformers' generate, without a KV cache (GPT has none): each new token reads the whole sequence,
        or its last block_size tokens (prepare_inputs_for_generation)."""
        kwargs["use_cache"] = False
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        """Each generation step's inputs, cropped to the last block_size tokens: the context GPT was trained on
        and has rotary tables for, as model.GPT.generate (sample.py) crops it."""
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        for key in ("input_ids", "attention_mask"):
            if isinstance(inputs.get(key), torch.Tensor):
                inputs[key] = inputs[key][:, -self.gpt.config.block_size :]
        return inputs

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        """Logits (B, T, vocab) of every position, and with labels the mean next-token loss (labels
        shifted here, -100 ignored, as transformers does). GPT has no padding mask: a batch may be
        padded on the right only (what a causal model's later positions never see)."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("nanodepth models take right padding only (tokenizer.padding_side = 'right')")
        if input_ids.size(1) > self.gpt.config.block_size:
            raise ValueError(
                f"{input_ids.size(1)} tokens are more than this model's block_size={self.gpt.config.block_size}; "
                f"give at most that many (generate crops its context to them itself)"
            )
        logits = self.gpt.lm_head(self.gpt.hidden(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)
