"""EagleProposer's drafts equal a plain torch EAGLE / EAGLE-3 head run over whole sequences.

Heads in the published layouts (config/eagle_head.py), scaled down and random, over a tiny random
Llama target. The engine side runs steps the way the runner will (prompt chunks that do not
sample, verification steps whose drafts are partly rejected, requests that join later), with the
token table and counts set as the post-update leaves them; the reference recomputes the head
over the whole known sequence without a KV cache for every draft, from transformers' hidden
states of the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from config.errors import ConfigError
from gpu_worker.spec_decode.eagle import EagleProposer
from gpu_worker.spec_decode.proposer import ProposeInputs
from tests.tiny_models import TINY, make_tiny_model
from tests.worker.runner_utils import hf_causal_lm, make_runner

K = 3
LAYERS = 8  # EAGLE-3's default aux layers (2, L // 2, L - 3) are distinct from 8 layers on
DRAFT_VOCAB = 100


def _head_config(target: Path, method: str, **extra) -> dict:
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=2 if method == "eagle" else 1, **extra)
    # As published: EAGLE's config gives its own rope_theta, EAGLE-3's none (Llama's default).
    del cfg["rope_parameters"]
    if method == "eagle":
        cfg["rope_theta"] = 500000.0
    else:
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["draft_vocab_size"] = DRAFT_VOCAB
    return cfg


def write_head(path: Path, target: Path, method: str, fc_bias: bool = False, **extra) -> Path:
    """A random head in the published layout: EAGLE's fc + layers.<i> (layer 0 without
    input_layernorm), or EAGLE-3's fc + midlayer + norm + lm_head + d2t/t2d."""
    cfg = _head_config(target, method, **extra)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(11 if method == "eagle" else 13)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    def layer(prefix: str, width: int, input_norm: bool) -> dict[str, torch.Tensor]:
        t = {
            f"{prefix}.self_attn.q_proj.weight": w(q, width),
            f"{prefix}.self_attn.k_proj.weight": w(kv, width),
            f"{prefix}.self_attn.v_proj.weight": w(kv, width),
            f"{prefix}.self_attn.o_proj.weight": w(h, q),
            f"{prefix}.mlp.gate_proj.weight": w(inter, h),
            f"{prefix}.mlp.up_proj.weight": w(inter, h),
            f"{prefix}.mlp.down_proj.weight": w(h, inter),
            f"{prefix}.post_attention_layernorm.weight": norm(),
        }
        if input_norm:
            t[f"{prefix}.input_layernorm.weight"] = norm()
        return t

    if method == "eagle":
        tensors = {"fc.weight": w(h, 2 * h)}
        if fc_bias:
            tensors["fc.bias"] = 0.1 * torch.randn(h, generator=gen)
        for i in range(cfg["num_hidden_layers"]):
            tensors |= layer(f"layers.{i}", h, input_norm=i > 0)
    else:
        targets = torch.randperm(cfg["vocab_size"], generator=gen)[:DRAFT_VOCAB].sort().values
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[targets] = True
        tensors = {
            "fc.weight": w(h, 3 * h),
            **layer("midlayer", 2 * h, input_norm=True),
            "midlayer.hidden_norm.weight": norm(),
            "norm.weight": norm(),
            "lm_head.weight": w(DRAFT_VOCAB, h),
            "d2t": targets - torch.arange(DRAFT_VOCAB),
            "t2d": t2d,
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path


# The reference: the head as the EAGLE papers and vLLM's llama_eagle*.py compute it, over a whole
# sequence of pairs with plain causal attention (no cache, no engine code).


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None].float()
    sin = torch.cat([angles.sin()] * 2, -1)[:, None].float()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _attention(x: torch.Tensor, t: dict, p: str, cfg: dict) -> torch.Tensor:
    n, heads, kv_heads = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    positions = torch.arange(n)
    q = _rope(
        (x @ t[f"{p}.q_proj.weight"].T).view(n, heads, d), positions, cfg.get("rope_theta", 10000.0)
    )
    k = _rope(
        (x @ t[f"{p}.k_proj.weight"].T).view(n, kv_heads, d),
        positions,
        cfg.get("rope_theta", 10000.0),
    )
    v = (x @ t[f"{p}.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = (a.repeat_interleave(heads // kv_heads, dim=1) for a in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return out @ t[f"{p}.o_proj.weight"].T


def _mlp(x: torch.Tensor, t: dict, p: str) -> torch.Tensor:
    gate, up = x @ t[f"{p}.gate_proj.weight"].T, x @ t[f"{p}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{p}.down_proj.weight"].T


def reference_head(method, t, cfg, embed, lm_head):
    """(embeds [n, H], hidden inputs [n, H]) -> (next token of each row, hidden fed next)."""
    eps = cfg["rms_norm_eps"]

    def run(e: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if method == "eagle":
            x = torch.cat([e, hid], -1) @ t["fc.weight"].T + t.get("fc.bias", 0.0)
            r = x + _attention(x, t, "layers.0.self_attn", cfg)
            out = r + _mlp(
                _rms(r, t["layers.0.post_attention_layernorm.weight"], eps), t, "layers.0.mlp"
            )
            for i in range(1, cfg["num_hidden_layers"]):
                p = f"layers.{i}"
                a = _attention(
                    _rms(out, t[f"{p}.input_layernorm.weight"], eps), t, f"{p}.self_attn", cfg
                )
                r = out + a
                out = r + _mlp(
                    _rms(r, t[f"{p}.post_attention_layernorm.weight"], eps), t, f"{p}.mlp"
                )
            return (out @ lm_head.T).argmax(-1), out
        p = "midlayer"
        x = torch.cat(
            [
                _rms(e, t[f"{p}.input_layernorm.weight"], eps),
                _rms(hid, t[f"{p}.hidden_norm.weight"], eps),
            ],
            -1,
        )
        r = hid + _attention(x, t, f"{p}.self_attn", cfg)
        pre = r + _mlp(_rms(r, t[f"{p}.post_attention_layernorm.weight"], eps), t, f"{p}.mlp")
        ids = (_rms(pre, t["norm.weight"], eps) @ t["lm_head.weight"].T).argmax(-1)
        return ids + t["d2t"][ids], pre

    return run


def reference_drafts(method, head_dir, hf_target, seq: list[int], count: int) -> list[int]:
    """count greedy drafts after the known tokens seq, recomputing the head over every pair."""
    from safetensors.torch import load_file

    t, cfg = (
        load_file(str(head_dir / "model.safetensors")),
        json.loads((head_dir / "config.json").read_text()),
    )
    embed = hf_target.model.embed_tokens.weight
    run = reference_head(method, t, cfg, embed, hf_target.lm_head.weight)
    with torch.inference_mode():
        states = hf_target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        if method == "eagle":
            hidden = states[-1][0]
        else:
            layers = (2, LAYERS // 2, LAYERS - 3)
            hidden = torch.cat([states[i][0] for i in layers], -1) @ t["fc.weight"].T
        tokens, drafts = list(seq[1:]), []
        for _ in range(count):
            ids, out = run(embed[torch.tensor(tokens)], hidden)
            drafts.append(int(ids[-1]))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


class Harness:
    """The runner's target forward and state, stepped as the speculative runner steps them;
    the proposer called after each step as the runner calls it."""

    def __init__(self, target: Path, head: Path, method: str, **engine_args) -> None:
        from engine_core.resolve import resolved_config

        self.runner, _ = make_runner(target, **engine_args)
        spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
        engine_args.setdefault("device", "cpu")
        engine_args.setdefault("kv_cache_memory", "64MiB")
        config = resolved_config(model=str(target), speculative_config=spec, **engine_args)
        self.proposer = EagleProposer(config, torch.device("cpu"))
        self.proposer.attach_target(self.runner.model)
        self.proposer.load()
        self.proposer.initialize_kv_cache(self.runner.num_blocks)
        self.seqs: dict[str, list[int]] = {}
        self.known: dict[str, int] = {}
        self.free = list(range(self.runner.num_blocks))
        self.gen = torch.Generator().manual_seed(3)

    def add(self, req_id: str, seq: list[int], prompt_len: int) -> None:
        states, bs = self.runner.states, self.runner.block_size
        blocks = [self.free.pop() for _ in range(-(-(len(seq) + K + 1) // bs))]
        slot = states.add(req_id, seq[:prompt_len], prompt_len, blocks, 0)
        states.apply_staged_writes()
        self.proposer.add_request(slot, 0)
        self.seqs[req_id], self.known[req_id] = seq, prompt_len

    def step(
        self, plan: dict[str, tuple[int, int, int]], guard=None
    ) -> dict[str, tuple[list[int], int]]:
        """plan: req_id -> (tokens computed, drafts among them accepted, max drafts). A request
        whose computed tokens reach its known ones samples: it verifies tokens - 1 drafts (the
        first `accepted` of them right) and gains accepted + 1 tokens. Returns each sampling
        request's drafts and the tokens it knows. guard: applied to the proposer's inputs."""
        states, tok = self.runner.states, self.runner.states.token_ids
        req_ids = list(plan)
        start = {r: int(states.num_computed_np[states.slot_of[r]]) for r in req_ids}
        for r, (n, a, _) in plan.items():
            slot, known, seq = states.slot_of[r], self.known[r], self.seqs[r]
            if start[r] + n > known:  # verification: the drafts after the newest token
                wrong = torch.randint(3, 512, (n - 1 - a,), generator=self.gen).tolist()
                tok[slot, known : known + n - 1] = torch.tensor(seq[known : known + a] + wrong)
        num_sched = np.array([plan[r][0] for r in req_ids], dtype=np.int64)
        batch = self.runner.inputs.prepare(req_ids, num_sched)
        hidden = self.runner._forward(batch)
        sampling, last_rows, max_drafts = [], [], []
        for b, r in enumerate(req_ids):
            n, a, most = plan[r]
            slot, seq, known = states.slot_of[r], self.seqs[r], self.known[r]
            computed = start[r] + n
            if computed >= known:  # sampled: the accepted drafts and one more token
                new_known = known + (a + 1 if computed > known else 1)
                tok[slot, known:new_known] = torch.tensor(seq[known:new_known])
                self.known[r] = new_known
                computed = new_known - 1
                sampling.append(r)
                last_rows.append(int(batch.query_start_loc_np[b]) + new_known - 2 - start[r])
                max_drafts.append(most)
            states.num_computed[slot] = computed
            states.num_computed_np[slot] = computed
            states.num_tokens[slot] = self.known[r]
            states.num_tokens_np[slot] = self.known[r]
        slots_np = np.array([states.slot_of[r] for r in sampling], dtype=np.int64)
        model = self.runner.model
        inputs = ProposeInputs(
            slots_np=slots_np,
            slots=torch.from_numpy(slots_np),
            num_tokens_np=np.array([self.known[r] for r in sampling], dtype=np.int64),
            max_drafts_np=np.array(max_drafts, dtype=np.int64),
            states=states,
            hidden_states=hidden,
            last_rows=torch.tensor(last_rows, dtype=torch.int64),
            aux_hidden_states=model.aux_hidden_states,
            batch=batch,
        )
        drafts = self.proposer.propose(inputs if guard is None else guard(inputs))
        drafts = drafts.as_subclass(torch.Tensor)  # the host reads them after the step's copy
        assert drafts.shape == (len(sampling), K) and drafts.dtype == torch.int64
        return {r: (drafts[i].tolist(), self.known[r]) for i, r in enumerate(sampling)}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def hf_target(target):
    return hf_causal_lm(target)


def _sequence(seed: int, length: int) -> list[int]:
    return torch.randint(
        3, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


PLAN = [
    # A: a 20-token prompt in chunks of 8, 8, 4; B: a 6-token prompt; C joins at step 3.
    {"A": (8, 0, K), "B": (6, 0, K)},
    {"A": (8, 0, K), "B": (4, 1, K)},
    {"A": (4, 0, 2), "B": (4, 3, 1), "C": (5, 0, 0)},
    {"A": (3, 0, K), "B": (2, 0, K), "C": (1, 0, K)},
    {"A": (4, 2, K), "B": (4, 3, 2), "C": (4, 1, K)},
    {"A": (4, 3, K), "B": (3, 0, K), "C": (2, 1, K)},
]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_a_whole_sequence_reference(method, target, hf_target, tmp_path):
    head = write_head(tmp_path / method, target, method, fc_bias=method == "eagle")
    harness = Harness(target, head, method)
    seqs = {r: _sequence(seed, 60) for seed, r in enumerate("ABC")}
    harness.add("A", seqs["A"], 20)
    harness.add("B", seqs["B"], 6)
    checked = 0
    for i, plan in enumerate(PLAN):
        if i == 2:
            harness.add("C", seqs["C"], 5)
        for r, (drafts, known) in harness.step(plan).items():
            most = plan[r][2]
            expected = reference_drafts(method, head, hf_target, seqs[r][:known], most)
            assert drafts == expected + [-1] * (K - most), f"step {i} request {r}"
            checked += most
    assert checked >= 25


def test_aux_hidden_states_are_the_layers_inputs(target, hf_target, tmp_path):
    """EAGLE-3 switches the target's hook on: the inputs of layers 2, 4 and 5 (transformers'
    hidden_states), for every computed position."""
    head = write_head(tmp_path / "h3", target, "eagle3")
    harness = Harness(target, head, "eagle3")
    seq = _sequence(5, 30)
    harness.add("A", seq, 17)
    harness.step({"A": (17, 0, K)})
    aux = harness.runner.model.aux_hidden_states
    with torch.inference_mode():
        states = hf_target(torch.tensor([seq[:17]]), output_hidden_states=True).hidden_states
    assert aux is not None and len(aux) == 3
    for got, layer in zip(aux, (2, 4, 5), strict=True):  # buffers: the step's rows first
        torch.testing.assert_close(got[:17], states[layer][0], atol=1e-5, rtol=1e-5)


def test_kv_block_bytes_count_the_heads_layers(target, tmp_path):
    harness = Harness(target, write_head(tmp_path / "h1", target, "eagle"), "eagle")
    # 2 layers x (K and V) x 2 KV heads x head_dim 16 x 16 positions x 4 bytes
    assert harness.proposer.kv_block_bytes() == 2 * 2 * 2 * 16 * 16 * 4


def _refusal(target: Path, head: Path, method: str = "eagle") -> str:
    """The one-line ConfigError resolving the configuration raises."""
    from engine_core.resolve import resolved_config

    spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    with pytest.raises(ConfigError) as e:
        resolved_config(model=str(target), device="cpu", speculative_config=spec)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_refusals(target, tmp_path):
    eagle3 = write_head(tmp_path / "e3", target, "eagle3")
    assert "holds an eagle3 head; use method eagle3" in _refusal(target, eagle3, "eagle")
    wide = write_head(tmp_path / "wide", target, "eagle", hidden_size=128)
    assert "hidden_size 128 differs from the target's 64" in _refusal(target, wide)
    vocab = write_head(tmp_path / "vocab", target, "eagle", vocab_size=1024)
    assert "vocab_size 1024 differs" in _refusal(target, vocab)
    few = make_tiny_model(tmp_path / "few", num_hidden_layers=4)
    assert "not three distinct layers" in _refusal(
        few, write_head(tmp_path / "e3b", few, "eagle3"), "eagle3"
    )
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(_head_config(target, "eagle")))
    torch.save({"fc.weight": torch.zeros(64, 128)}, pickled / "pytorch_model.bin")
    assert "PyTorch pickles are not loaded" in _refusal(target, pickled)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(_head_config(target, "eagle")))
    save_file({"lm_head.weight": torch.zeros(512, 64)}, str(plain / "model.safetensors"))
    assert "not an EAGLE head in a published layout" in _refusal(target, plain)


def test_propose_reads_nothing_back_from_the_device(target, hf_target, tmp_path):
    """Every tensor the proposer reads that would live on a GPU guarded (a host read raises,
    tests/worker/test_no_host_reads.py): the steps run, and draft as the reference does."""
    from dataclasses import replace

    from tests.worker.test_no_host_reads import _guard

    head = write_head(tmp_path / "h3", target, "eagle3")
    harness = Harness(target, head, "eagle3")
    states = harness.runner.states
    for name in ("token_ids", "block_table", "num_computed", "num_tokens"):
        setattr(states, name, _guard(getattr(states, name)))
    for attn in harness.proposer.head.attention_layers():
        attn.kv_cache = _guard(attn.kv_cache)

    def guard(inputs: ProposeInputs) -> ProposeInputs:
        batch = inputs.batch
        device_batch = replace(
            batch.device_batch,
            query_start_loc=_guard(batch.device_batch.query_start_loc),
            seq_lens=_guard(batch.device_batch.seq_lens),
            block_table=_guard(batch.device_batch.block_table),
            slot_mapping=_guard(batch.device_batch.slot_mapping),
        )
        return replace(
            inputs,
            slots=_guard(inputs.slots),
            hidden_states=_guard(inputs.hidden_states),
            last_rows=_guard(inputs.last_rows),
            aux_hidden_states=[_guard(a) for a in inputs.aux_hidden_states],
            batch=replace(
                batch,
                slots=_guard(batch.slots),
                positions=_guard(batch.positions),
                device_batch=device_batch,
            ),
        )

    seqs = {r: _sequence(30 + i, 40) for i, r in enumerate("AB")}
    harness.add("A", seqs["A"], 9)
    harness.add("B", seqs["B"], 5)
    for plan in ({"A": (9, 0, K), "B": (5, 0, K)}, {"A": (4, 1, K), "B": (4, 3, 2)}):
        for r, (drafts, known) in harness.step(plan, guard).items():
            expected = reference_drafts("eagle3", head, hf_target, seqs[r][:known], plan[r][2])
            assert drafts == expected + [-1] * (K - plan[r][2])
