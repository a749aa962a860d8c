"""``load_offloaded``: an MoE checkpoint loaded without its experts, offloaded from the checkpoint.

Every family's ``save_pretrained`` layout (per expert; mixtral's ``block_sparse_moe.*.w1/w3/w2``),
a sharded index, and the fused layout load; offloaded decoding over the loaded model is
token-identical to the resident model's, with the experts' parameters still on ``meta`` and
the disk tier written an expert at a time (never a whole layer's tensor); bad input is refused
with a message naming it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from leapfx import rewrite
from leapfx.offload import CheckpointExperts, DiskStore, OffloadOptions, load_offloaded
from leapfx.offload.checkpoint import EXPERT_SOURCE, checkpoint_only
from tests.conftest import MOE_ARCHS, tiny_model, tiny_moe_model

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 8, 61, 23]])


def _decode(model, recipe="autoregressive", offload=None, **options):
    sm = rewrite.apply(model, recipe, offload=offload, **options)
    with torch.inference_mode():
        return sm.generate(PROMPT, max_new_tokens=12)


def _saved(tmp_path, arch="olmoe", *, shard=False, **kw):
    model = tiny_moe_model(arch, intermediate=32, **kw)
    model.save_pretrained(tmp_path / arch, **({"max_shard_size": "20KB"} if shard else {}))
    return model, tmp_path / arch


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_loaded_checkpoint_decodes_like_the_resident_model(tmp_path, arch, monkeypatch):
    resident, path = _saved(tmp_path, arch)
    keys = json.dumps(list(safe_open(str(path / "model.safetensors"), "pt").keys()))
    assert ".experts.0." in keys  # save_pretrained wrote the per-expert layout
    # the disk tier must be written an expert at a time: a whole-layer read is an error here
    monkeypatch.setattr(CheckpointExperts, "materialize", lambda self: pytest.fail("materialized"))
    model = load_offloaded(path)
    held = checkpoint_only(model)
    assert len(held) == 4
    for name in held:
        experts = model.get_submodule(name)
        assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
        gate_up, down = getattr(experts, EXPERT_SOURCE)
        assert gate_up.shape == experts.gate_up_proj.shape and down.shape == experts.down_proj.shape
    idx = int(held[1].split(".")[2])
    res = resident.model.layers[idx].mlp.experts
    gate_up, down = getattr(model.get_submodule(held[1]), EXPERT_SOURCE)
    for e in range(len(gate_up)):
        assert torch.equal(gate_up[e], res.gate_up_proj[e])
        assert torch.equal(down[e], res.down_proj[e])
    want = _decode(resident)
    for prefetch in ("none", "next_gate"):
        options = OffloadOptions(slots=0.5, prefetch=prefetch, poison=True, engine="thread",
                                 transfer_delay_s=1e-3)  # fmt: skip
        assert torch.equal(_decode(model, offload=options), want), prefetch
    for name in held:  # nothing was materialized into the model
        assert model.get_submodule(name).gate_up_proj.is_meta


def test_a_speculative_recipe_and_the_cpu_kernels_over_a_loaded_checkpoint(tmp_path):
    resident, path = _saved(tmp_path, "olmoe", layers=6)
    model = load_offloaded(path)
    options = OffloadOptions(slots=0.5, prefetch="verify_union", poison=True)
    want = _decode(resident)
    got = _decode(model, "layerskip", offload=options, exit_layer=3, num_speculations=3)
    assert torch.equal(got, want)
    got = _decode(model, offload=OffloadOptions(slots=0.5, slow_dtype="auto"), cpu_kernels=True)
    assert torch.equal(got, want)


def test_tied_embeddings(tmp_path):
    resident, path = _saved(tmp_path, "olmoe", tie=True)
    model = load_offloaded(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_decode(model, offload=OffloadOptions(slots=0.5)), _decode(resident))


def test_a_sharded_checkpoint_and_the_host_tier(tmp_path):
    resident, path = _saved(tmp_path, "qwen2_moe", shard=True)
    assert (path / "model.safetensors.index.json").is_file()
    model = load_offloaded(path)
    assert torch.equal(_decode(model, offload=OffloadOptions(slots=0.5, tier="host")),
                       _decode(resident))  # fmt: skip


def test_the_fused_layout(tmp_path):
    resident = tiny_moe_model("qwen3_moe", intermediate=32)
    path = tmp_path / "fused"
    resident.save_pretrained(path)
    state = {k: v.contiguous() for k, v in resident.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = load_offloaded(path)
    assert torch.equal(_decode(model, offload=OffloadOptions(slots=0.5)), _decode(resident))


def test_bad_input_is_refused_with_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_offloaded(tmp_path)
    resident, path = _saved(tmp_path, "olmoe")
    with pytest.raises(ValueError, match=r"dtype: .*allowed: a floating torch.dtype"):
        load_offloaded(path, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"device: 'gpu0' is invalid; allowed: a torch device"):
        load_offloaded(path, device="gpu0")
    model = load_offloaded(path)
    with pytest.raises(ValueError, match=r"offload: None, and the experts of .* allowed: offload="):
        rewrite.apply(model, "autoregressive")
    # EAGLE's head starts as a copy of a host layer: not of experts held in the checkpoint only
    with pytest.raises(ValueError, match=r"init_layer: the host layer 3's mlp.experts.* allowed:"):
        rewrite.apply(model, "eagle", offload=OffloadOptions(slots=0.5))
    dense = tiny_model()
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="without MoE layers"):
        load_offloaded(tmp_path / "dense")
    (path / "model.safetensors").rename(path / "other.safetensors")
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_offloaded(path)
    state = dict(resident.state_dict())
    state.pop("model.norm.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks \['model.norm.weight'\]"):
        load_offloaded(path)
    state = dict(resident.state_dict())
    state.pop("model.layers.1.mlp.experts.down_proj")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no experts for 'model.layers.1.mlp.experts'"):
        load_offloaded(path)


def test_a_given_disk_tier_file_is_reused_only_when_written_from_the_same(tmp_path, monkeypatch):
    resident, path = tiny_moe_model("olmoe", intermediate=32).half(), tmp_path / "half"
    resident.save_pretrained(path)  # float16, computed in float32: float16 holds it exactly
    resident = resident.float()
    want = _decode(resident)
    file = tmp_path / "tier" / "experts.bin"
    file.parent.mkdir()
    writes = []
    write = DiskStore._write
    monkeypatch.setattr(DiskStore, "_write", lambda s, layers: (writes.append(1), write(s, layers)))

    def run(model, **kw):
        writes.clear()
        sm = rewrite.apply(model, "autoregressive",
                           offload=OffloadOptions(slots=0.5, path=str(file), **kw))  # fmt: skip
        with torch.inference_mode():
            assert torch.equal(sm.generate(PROMPT, max_new_tokens=12), want)
        store = sm.offload.store
        assert store.reused == (not writes)
        sm.offload.close()
        return store.reused

    assert not run(load_offloaded(path))  # written, with its manifest
    assert sorted(p.name for p in file.parent.iterdir()) == ["experts.bin", "experts.bin.json"]
    assert run(load_offloaded(path))  # the same checkpoint and layout: read as it is
    assert not run(load_offloaded(path), slow_dtype="float16")  # another file dtype
    assert run(load_offloaded(path), slow_dtype="auto")  # float16 again (the checkpoint's own)
    st = os.stat(path / "model.safetensors")
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not run(load_offloaded(path), slow_dtype="auto")  # the checkpoint changed
    with open(file, "r+b") as f:
        f.truncate(4096)
    assert not run(load_offloaded(path), slow_dtype="auto")  # a file cut short
    assert not run(resident)  # experts from memory: always written, the manifest removed
    assert not (tmp_path / "tier" / "experts.bin.json").exists()
    assert not run(load_offloaded(path))


def test_a_checkpoint_stored_in_float16_needs_no_read_to_narrow(tmp_path, monkeypatch):
    resident = tiny_moe_model("olmoe", intermediate=32).half()
    resident.save_pretrained(tmp_path / "half")
    model = load_offloaded(tmp_path / "half")
    gate_up, _ = getattr(model.get_submodule(checkpoint_only(model)[0]), EXPERT_SOURCE)
    assert gate_up.stored_dtype == torch.float16 and gate_up.dtype == torch.float32
    reads = []
    getitem = CheckpointExperts.__getitem__
    monkeypatch.setattr(CheckpointExperts, "__getitem__",
                        lambda s, e: (reads.append(e), getitem(s, e))[1])  # fmt: skip
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=0.5, slow_dtype="auto"))  # fmt: skip
    assert sm.offload.store.file_dtype == torch.float16
    # each expert once for the file, and expert 0 once for bfloat16's check, which fails
    # there; a float16 check that read them would be 32 more
    assert len(reads) == 4 * 4 * 2 + 1
    with torch.inference_mode():
        want = rewrite.apply(resident.float(), "autoregressive").generate(PROMPT, max_new_tokens=12)
        assert torch.equal(sm.generate(PROMPT, max_new_tokens=12), want)


@pytest.mark.gpu
def test_a_loaded_checkpoint_on_cuda_uses_the_pinned_host_tier(tmp_path):
    resident, path = _saved(tmp_path, "olmoe")
    prompt = PROMPT.cuda()
    with torch.inference_mode():
        want = rewrite.apply(resident.cuda(), "autoregressive").generate(prompt, max_new_tokens=12)
    model = load_offloaded(path, device="cuda")
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=0.5, poison=True))  # fmt: skip
    assert type(sm.offload.engine).__name__ == "CudaEngine" and sm.offload.store.pinned
    with torch.inference_mode():
        assert torch.equal(sm.generate(prompt, max_new_tokens=12), want)
