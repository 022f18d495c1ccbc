"""``--compute-in-loaded-dtype auto`` on models sharded as accelerate's FSDP2 ``TRANSFORMER_BASED_WRAP`` shards them.

accelerate 1.16 gives the embedding, each decoder layer, the final norm and the head groups of
their own, then shards the root model, which holds transformers' ``_keep_in_fp32_modules(_strict)``
and is left with no parameters (no group). ``auto`` must still find the lists there. Tiny models
from configs (no download): DeepSeek-V3 (router ``gate.weight`` kept in fp32) and a Llama whose
strict list names its norms. Reference: each selected module an fp32 FSDP unit of its own with
``output_dtype=bf16`` (what users write today), in plain torch.
"""

from __future__ import annotations

import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from common import FSDPExtTestCase, MixedPrecisionPolicy, full_params, fully_shard, needs_dtype_fix, plugin, plugin_specific
from test_compute_dtype import record_compute_dtypes
from test_integration import has_transformers, tiny_llama, train_llama
from torch_fsdp_ext import _compute_dtype

BF16, FP32 = torch.bfloat16, torch.float32
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
UNIT = MixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32, output_dtype=BF16)


def tiny_deepseek_v3() -> nn.Module:
    """A bf16 DeepseekV3ForCausalLM (one dense, one MoE layer) with its router weight kept in fp32, as loaded."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(BF16)
    assert "gate.weight" in model._keep_in_fp32_modules_strict  # transformers' own list
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.float()  # what from_pretrained(dtype=bf16) does with the strict list
    return model


def llama_keeping_norms_in_fp32() -> nn.Module:
    """A Llama subclass whose strict list names its norms (bf16, norms fp32 as loaded)."""
    model = tiny_llama()
    model._keep_in_fp32_modules_strict = ["input_layernorm", "post_attention_layernorm", "norm"]
    return model


def kept_in_fp32(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(p.dtype == FP32 for p in m.parameters(recurse=False))]


def shard_as_accelerate(model: nn.Module, skip: tuple = ()) -> None:
    """TRANSFORMER_BASED_WRAP: embedding, each decoder layer, final norm, head, then the root (no parameters left)."""
    inner = model.model
    for module in (inner.embed_tokens, *inner.layers, inner.norm, model.lm_head, model):
        if module not in skip:
            fully_shard(module, mp_policy=POLICY)


@needs_dtype_fix
@plugin_specific
@unittest.skipUnless(has_transformers, "transformers is not installed (pip install '.[test]')")
class TestAutoFindsTheLists(FSDPExtTestCase):
    def _compare(self, make_model, selected_names: str) -> None:
        results = {}
        for layout in ("auto", "units"):
            with plugin(layout == "auto", dtype_strategy="preserve"):
                model = make_model()
                units = kept_in_fp32(model)
                self.assertTrue(units)
                if layout == "units":
                    for module in units:
                        fully_shard(module, mp_policy=UNIT)
                _compute_dtype.set_default_selectors("auto" if layout == "auto" else None,
                                                     _compute_dtype.LAUNCHER_OPTION)
                try:
                    shard_as_accelerate(model, skip=tuple(units) if layout == "units" else ())
                    self.assertFalse(any(True for _ in model.parameters(recurse=False)))
                    with record_compute_dtypes(model) as seen:
                        losses = train_llama(model, self.rank)
                finally:
                    _compute_dtype.set_default_selectors(None)
                results[layout] = (losses, full_params(model), seen)
        self.assertTrue(all(torch.isfinite(torch.tensor(results["auto"][0]))))
        self.assertEqual(results["auto"][0], results["units"][0])
        for name, value in results["auto"][1].items():
            self.assertTrue(torch.equal(value, results["units"][1][name]), name)
        for (_, name), dtypes in results["auto"][2].items():
            self.assertEqual(dtypes, {FP32 if selected_names in name else BF16}, name)

    def test_deepseek_v3_router_computes_in_fp32(self):
        self._compare(tiny_deepseek_v3, "mlp.gate.")

    def test_llama_whose_strict_list_names_its_norms(self):
        self._compare(llama_keeping_norms_in_fp32, "norm")

    def test_upcast_reads_the_loaded_dtypes(self):
        """Under upcast every master is fp32 by the first forward; auto still selects only what was loaded in fp32."""
        with plugin(True, dtype_strategy="upcast"):
            model = llama_keeping_norms_in_fp32()
            _compute_dtype.set_default_selectors("auto", _compute_dtype.LAUNCHER_OPTION)
            try:
                shard_as_accelerate(model)
                torch_fsdp_ext.upcast_now(model)
                self.assertEqual({p.dtype for p in model.parameters()}, {FP32})
                with record_compute_dtypes(model) as seen:
                    train_llama(model, self.rank)
            finally:
                _compute_dtype.set_default_selectors(None)
        for (_, name), dtypes in seen.items():
            self.assertEqual(dtypes, {FP32 if "norm" in name else BF16}, name)

    def test_a_model_without_lists_names_the_setting_used(self):
        for setting, expected in ((_compute_dtype.LAUNCHER_OPTION, "--compute-in-loaded-dtype auto reads"),
                                  (_compute_dtype.ENV_VAR, "TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=auto reads")):
            with plugin(True, dtype_strategy="preserve"):
                model = tiny_llama()  # no list declared
                _compute_dtype.set_default_selectors("auto", setting)
                try:
                    shard_as_accelerate(model)
                    with self.assertRaises(ValueError) as caught:
                        train_llama(model, self.rank)
                finally:
                    _compute_dtype.set_default_selectors(None)
            self.assertEqual(
                str(caught.exception),
                f"torch_fsdp_ext: {expected} the modules to keep in fp32 from transformers' _keep_in_fp32_modules and "
                "_keep_in_fp32_modules_strict, which model LlamaForCausalLM and every module in it leave empty, so "
                f"name the modules instead, as in {expected.split(' auto')[0].split('=auto')[0]}"
                f"{' ' if setting == _compute_dtype.LAUNCHER_OPTION else '='}LlamaRMSNorm.",
            )


if __name__ == "__main__":
    run_tests()
