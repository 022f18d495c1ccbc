"""Ship as loaded: after training in fp32 masters, every export API gives the loaded dtypes.

The reference for every value is torch's own full state dict of the trained model
(``get_model_state_dict(full_state_dict=True)``: the fp32 masters) rounded by
``Tensor.to`` to the dtype the model was loaded in; results must equal it bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
import torch_fsdp_ext.__main__
from torch_fsdp_ext._dtype import _loaded_dtypes

from common import (
    ROOT,
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    fully_shard,
    mixed_llama,
    needs_dtype_fix,
    plugin,
    plugin_specific,
    pretrained_llama,
    seed_000_model,
    shard_model,
    shared_temp_dir,
    train_lm,
)

BF16_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
needs_transformers = unittest.skipIf(importlib.util.find_spec("transformers") is None, "transformers is not installed")
needs_peft = unittest.skipIf(importlib.util.find_spec("peft") is None, "peft is not installed")


def full_masters(model: nn.Module, **options) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, **options))


def rounded(masters: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    return {fqn: tensor.to(dtypes[fqn]) for fqn, tensor in masters.items()}


def stream_digest(pairs) -> str:
    digest = hashlib.sha256()
    for fqn, tensor in pairs:
        digest.update(f"{fqn}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TestAsLoaded(FSDPExtTestCase):
    def assert_bitwise_equal(self, actual: dict, expected: dict) -> None:
        self.assertEqual(list(actual), list(expected))
        for fqn, tensor in expected.items():
            self.assertEqual(actual[fqn].dtype, tensor.dtype, fqn)
            self.assertTrue(torch.equal(actual[fqn].cpu(), tensor.cpu()), fqn)

    def trained_upcast_model(self, **install_kwargs) -> tuple[nn.Module, dict[str, torch.dtype]]:
        model = seed_000_model()
        loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
        shard_model(model, mp_policy=BF16_MP)
        train_lm(model, torch.optim.AdamW(model.parameters(), lr=1e-2), self.rank, steps=2)
        return model, loaded

    @needs_dtype_fix
    @plugin_specific
    def test_every_api_gives_the_masters_rounded_to_the_loaded_dtypes(self):
        with plugin(True):
            model, loaded = self.trained_upcast_model()
            # What users get from torch today: fp32 everywhere, twice the loaded bytes of every bf16 tensor.
            masters = full_masters(model)
            self.assertEqual(masters["layers.0.wq.weight"].dtype, torch.float32)
            self.assertEqual(loaded["layers.0.wq.weight"], torch.bfloat16)

            self.assertEqual(torch_fsdp_ext.loaded_dtypes(model), loaded)
            expected = rounded(masters, loaded)
            self.assertIn(torch.float32, {t.dtype for t in expected.values()})  # the norms stay fp32

            on_rank0 = torch_fsdp_ext.state_dict_as_loaded(model)
            if self.rank == 0:
                self.assert_bitwise_equal(on_rank0, expected)
                self.assertTrue(all(t.device.type == "cpu" for t in on_rank0.values()))
            else:
                self.assertEqual(on_rank0, {})
            self.assert_bitwise_equal(torch_fsdp_ext.state_dict_as_loaded(model, cpu_offload=False), expected)

            streamed = list(torch_fsdp_ext.iter_state_dict_as_loaded(model))
            self.assert_bitwise_equal(dict(streamed), expected)
            digests = [None] * self.world_size
            dist.all_gather_object(digests, stream_digest(streamed))
            self.assertEqual(len(set(digests)), 1)  # every rank gets the same stream

            # Exporting changes nothing: the model trains on from the same masters.
            self.assert_bitwise_equal(full_masters(model), masters)

    @needs_dtype_fix
    @plugin_specific
    def test_shards_of_unequal_size_gather_exactly(self):
        # dim 0 of 33 rows: 17 and 16 per rank; of one row: rank 1 holds an empty shard.
        with plugin(True):
            model = seed_000_model(vocab=33)
            model.layers[0].one_row = nn.Linear(16, 1).to(torch.bfloat16)
            loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
            shard_model(model, mp_policy=BF16_MP)
            train_lm(model, torch.optim.AdamW(model.parameters(), lr=1e-2), self.rank, steps=1)
            self.assertEqual(model.layers[0].one_row.bias.to_local().numel(), 1 - self.rank)
            expected = rounded(full_masters(model), loaded)
            self.assert_bitwise_equal(dict(torch_fsdp_ext.iter_state_dict_as_loaded(model)), expected)
            self.assert_bitwise_equal(torch_fsdp_ext.state_dict_as_loaded(model, cpu_offload=False), expected)
            # A CPU mesh gathers in pieces: here of one row per rank.
            with mock.patch.object(_loaded_dtypes, "_CPU_PIECE_BYTES", 64):
                self.assert_bitwise_equal(dict(torch_fsdp_ext.iter_state_dict_as_loaded(model)), expected)

    @plugin_specific
    def test_preserve_equals_the_plain_full_state_dict(self):
        with plugin(True, dtype_strategy="preserve"):
            model = shard_model(mixed_llama())
            train_lm(model, torch.optim.AdamW(model.parameters(), lr=1e-2), self.rank, steps=2)
            self.assert_bitwise_equal(torch_fsdp_ext.state_dict_as_loaded(model, cpu_offload=False), full_masters(model))

    @needs_dtype_fix
    @plugin_specific
    def test_compute_dtype_model_and_tied_weights_come_back_as_loaded(self):
        with plugin(True):
            model = seed_000_model()
            model.head.weight = model.embed.weight  # tied: one parameter, two state-dict entries
            loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
            policy = torch_fsdp_ext.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                param_dtype_override_fn=torch_fsdp_ext.compute_in_loaded_dtype(model, ["RMSNorm"]),
            )
            fully_shard(model, mp_policy=policy)  # tied weights share one group
            train_lm(model, torch.optim.AdamW(model.parameters(), lr=1e-2), self.rank, steps=2)
            self.assertEqual(torch_fsdp_ext.loaded_dtypes(model), loaded)
            as_loaded = torch_fsdp_ext.state_dict_as_loaded(model, cpu_offload=False)
            self.assert_bitwise_equal(as_loaded, rounded(full_masters(model), loaded))
            self.assertTrue(torch.equal(as_loaded["head.weight"], as_loaded["embed.weight"]))

    @needs_dtype_fix
    @plugin_specific
    def test_dcp_checkpoint_resumes_in_masters_and_exports_as_loaded(self):
        with plugin(True), shared_temp_dir("loaded_dtypes_dcp") as path:
            model, loaded = self.trained_upcast_model()
            checkpoint, out = os.path.join(path, "step-2"), os.path.join(path, "release")
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
            torch_fsdp_ext.save_loaded_dtypes(model, checkpoint)
            expected = torch_fsdp_ext.state_dict_as_loaded(model)

            # The resume is unchanged for torch: fp32 masters, bit for bit.
            fresh = shard_model(seed_000_model(seed=1), mp_policy=BF16_MP)
            state = {"model": get_model_state_dict(fresh)}
            dcp.load(state, checkpoint_id=checkpoint)
            fresh.load_state_dict(state["model"])
            self.assert_bitwise_equal(full_masters(fresh), full_masters(model))

            dist.barrier()
            if self.rank == 0:
                subprocess.run(
                    [sys.executable, "-m", "torch_fsdp_ext", "export", checkpoint, out],
                    check=True, cwd=ROOT, capture_output=True, timeout=120,
                    env={**os.environ, "TORCH_FSDP_EXT_DISABLE": "1"},
                )
                from safetensors.torch import load_file

                self.assert_bitwise_equal(load_file(os.path.join(out, "model.safetensors")), expected)

    @needs_dtype_fix
    @needs_transformers
    @plugin_specific
    def test_save_pretrained_writes_the_loaded_dtypes_and_sizes(self):
        from safetensors import safe_open

        def safetensors_of(directory: str) -> tuple[int, dict[str, torch.dtype]]:
            path = os.path.join(directory, "model.safetensors")
            with safe_open(path, "pt") as f:
                return os.path.getsize(path), {key: f.get_slice(key).get_dtype() for key in f.keys()}

        with plugin(True), shared_temp_dir("loaded_dtypes_hf") as path:
            init_dir, loaded_dir, release_dir = (os.path.join(path, name) for name in ("init", "loaded", "release"))
            if self.rank == 0:
                from transformers import LlamaConfig, LlamaForCausalLM

                config = LlamaConfig(
                    vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
                )
                torch.manual_seed(0)
                LlamaForCausalLM(config).save_pretrained(init_dir)
                pretrained_llama(init_dir).save_pretrained(loaded_dir)  # the bf16 + fp32-norm checkpoint
            dist.barrier()
            model = pretrained_llama(loaded_dir)
            model.config._attn_implementation = "eager"
            loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=BF16_MP)
            fully_shard(model, mp_policy=BF16_MP)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(2):
                tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step + 10 * self.rank))
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            expected = rounded(full_masters(model, cpu_offload=True), loaded)
            state_dict = torch_fsdp_ext.state_dict_as_loaded(model)
            if self.rank == 0:
                model.save_pretrained(release_dir, state_dict=state_dict)
                self.assertEqual(safetensors_of(release_dir), safetensors_of(loaded_dir))
                reloaded = pretrained_llama(release_dir).state_dict()
                for fqn, tensor in reloaded.items():
                    self.assertTrue(torch.equal(tensor, expected[fqn]), fqn)
            dist.barrier()

    @needs_dtype_fix
    @needs_peft
    @plugin_specific
    def test_peft_adapters_come_back_as_loaded(self):
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        with plugin(True):
            torch.manual_seed(0)
            base = seed_000_model()
            # fp32 adapters (peft's default) next to a trainable bf16 copy of the head: one mixed group.
            model = get_peft_model(base, LoraConfig(r=4, target_modules=["wq", "wo"], modules_to_save=["head"]))
            loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
            for layer in model.base_model.model.layers:
                fully_shard(layer, mp_policy=BF16_MP)
            fully_shard(model, mp_policy=BF16_MP)
            train_lm(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                     self.rank, steps=2)
            expected = rounded(full_masters(model), loaded)
            as_loaded = torch_fsdp_ext.state_dict_as_loaded(model, cpu_offload=False)
            self.assert_bitwise_equal(as_loaded, expected)
            adapters = get_peft_model_state_dict(model, state_dict=as_loaded)
            self.assertTrue(adapters)
            self.assertEqual({k: t.dtype for k, t in adapters.items()},
                             {k: t.dtype for k, t in get_peft_model_state_dict(model, state_dict=expected).items()})


    @needs_dtype_fix
    @needs_peft
    @plugin_specific
    def test_peft_merged_on_one_process_from_the_release_dict_equals_the_merged_masters(self):
        """The documented recipe: load ``state_dict_as_loaded`` into a fresh peft model on rank 0, merge_and_unload.

        Against a reference that merges the fp32 masters themselves and rounds once: equal
        bit for bit, because a frozen base weight never changed dtype and the adapters
        train in the dtype they were loaded in.
        """
        from peft import LoraConfig, get_peft_model

        def lora() -> LoraConfig:
            return LoraConfig(r=4, target_modules=["wq", "wo"], modules_to_save=["head"])

        with plugin(True):
            torch.manual_seed(0)
            model = get_peft_model(seed_000_model(), lora())
            for layer in model.base_model.model.layers:
                fully_shard(layer, mp_policy=BF16_MP)
            fully_shard(model, mp_policy=BF16_MP)
            train_lm(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                     self.rank, steps=2)
            masters = full_masters(model, cpu_offload=True)
            release = torch_fsdp_ext.state_dict_as_loaded(model)
        if self.rank == 0:
            fresh = get_peft_model(seed_000_model(), lora())
            fresh.load_state_dict(release)
            merged = fresh.merge_and_unload().state_dict()
            in_masters = get_peft_model(seed_000_model().float(), lora())
            in_masters.load_state_dict(masters)
            loaded = {fqn: t.dtype for fqn, t in seed_000_model().state_dict().items()}
            expected = {fqn: t.to(loaded[fqn]) for fqn, t in in_masters.merge_and_unload().state_dict().items()}
            self.assert_bitwise_equal(merged, expected)
            self.assertFalse(torch.equal(merged["layers.0.wq.weight"], seed_000_model().layers[0].wq.weight))
        dist.barrier()

class TestExportBadInput(TestCase):
    """``python -m torch_fsdp_ext export`` on damaged checkpoints: one clear error, nothing partial left."""

    def setUp(self) -> None:
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="torch_fsdp_ext_export_")
        self.addCleanup(shutil.rmtree, self.root)
        self.checkpoint, self.out = os.path.join(self.root, "ckpt"), os.path.join(self.root, "release")
        model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8))
        dcp.save({"model": model.state_dict()}, checkpoint_id=self.checkpoint, no_dist=True)
        torch_fsdp_ext.save_loaded_dtypes(model, self.checkpoint)
        self.expected = model.state_dict()
        self.shard = os.path.join(self.checkpoint, next(n for n in os.listdir(self.checkpoint) if n.endswith(".distcp")))
        os.makedirs(self.out)
        self.previous = os.path.join(self.out, "model.safetensors")
        with open(self.previous, "wb") as f:
            f.write(b"an earlier export")

    def export(self) -> tuple[int, str]:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = torch_fsdp_ext.__main__.main(["export", self.checkpoint, self.out])
        return code, stderr.getvalue()

    def assert_refused(self, path: str, what: str) -> None:
        code, stderr = self.export()
        self.assertEqual(code, 1)
        self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
        self.assertIn(f"torch_fsdp_ext export: {path}: {what}", stderr)
        self.assertEqual(os.listdir(self.out), ["model.safetensors"])  # no partial file beside it
        with open(self.previous, "rb") as f:
            self.assertEqual(f.read(), b"an earlier export")  # never replaced by a partial one

    def test_intact_checkpoint_replaces_the_output(self) -> None:
        from safetensors.torch import load_file

        self.assertEqual(self.export(), (0, ""))
        self.assertEqual(os.listdir(self.out), ["model.safetensors"])
        exported = load_file(self.previous)
        self.assertEqual({k: v.dtype for k, v in exported.items()}, {k: v.dtype for k, v in self.expected.items()})
        self.assertEqual(exported, self.expected, atol=0, rtol=0)

    def test_missing_metadata(self) -> None:
        os.remove(os.path.join(self.checkpoint, ".metadata"))
        self.assert_refused(os.path.join(self.checkpoint, ".metadata"), "missing")

    def test_missing_shard(self) -> None:
        os.remove(self.shard)
        self.assert_refused(self.shard, "missing")

    def test_truncated_shard(self) -> None:
        size = os.path.getsize(self.shard)
        os.truncate(self.shard, size // 2)
        self.assert_refused(self.shard, f"truncated ({size // 2} bytes")

    def test_damaged_shard_of_full_length_fails_while_writing(self) -> None:
        size = os.path.getsize(self.shard)
        with open(self.shard, "wb") as f:
            f.write(b"\0" * size)
        self.assert_refused(self.checkpoint, "reading")

    def test_broken_sidecar_json(self) -> None:
        sidecar = os.path.join(self.checkpoint, _loaded_dtypes.SIDECAR)
        with open(sidecar) as f:
            text = f.read()
        with open(sidecar, "w") as f:
            f.write(text[: len(text) // 2])
        self.assert_refused(sidecar, "unreadable")

    def test_missing_sidecar(self) -> None:
        sidecar = os.path.join(self.checkpoint, _loaded_dtypes.SIDECAR)
        os.remove(sidecar)
        self.assert_refused(sidecar, "missing. Write it when saving the checkpoint")


if __name__ == "__main__":
    run_tests()
