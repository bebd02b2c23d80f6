"""DFlash 2 (SPEC 3): the dynamic conv and its kernel, the state cache, the selector, and
lossless decoding with DFlash 2 drafts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx import LoadError, generate, load_draft
from dflash_mlx.engine import sampling
from dflash_mlx.engine.sampling import SamplingParams, propose, selector_walk
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.conv import (
    CONV_KERNEL_SOURCE,
    dynamic_conv_metal,
    dynamic_conv_reference,
    use_metal_kernel,
)
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.selector import CandidateSelector
from dflash_mlx.pair import Pair

from .conftest import build_draft, draft_config
from .test_decode import PROMPTS, target_greedy
from .test_sampling import (
    JOINT_PARAMS,
    TableDraft,
    build_tiny_vocab_pair,
    chi_square_rejects,
    exact_joint,
    exact_second_token,
    greedy_table,
    joint_counts,
    joint_rejects,
    second_token_counts,
)


def conv_loop(x, base, delta, state):
    """The formula, one output element at a time (numpy, float64)."""
    B, L, D = x.shape
    taps = base.shape[0]
    g = D // delta.shape[-1]
    out = np.zeros((B, L, D))
    for b in range(B):
        for t in range(L):
            for c in range(D):
                for j in range(taps):
                    s = t - j
                    if s >= 0:
                        xv = x[b, s, c]
                    elif s == -1 and state is not None:
                        xv = state[b, c]
                    else:
                        xv = 0.0
                    out[b, t, c] += (base[j, c] + delta[b, t, j, c // g]) * xv
    return out


def random_conv_inputs(seed, B=2, L=8, D=64, taps=2, g=16, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, L, D))
    base = rng.normal(size=(taps, D))
    delta = rng.normal(size=(B, L, taps, D // g))
    state = rng.normal(size=(B, D))
    return [a.astype(np.float32) for a in (x, base, delta, state)]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("shape", [(1, 16, 64), (2, 8, 32), (3, 5, 128)])
def test_conv_reference_equals_the_formula(shape, with_state):
    B, L, D = shape
    x, base, delta, state = random_conv_inputs(sum(shape), B, L, D)
    st = state if with_state else None
    got = dynamic_conv_reference(
        mx.array(x), mx.array(base), mx.array(delta), mx.array(st) if with_state else None
    )
    np.testing.assert_allclose(np.array(got), conv_loop(x, base, delta, st), atol=1e-4)


def test_block_index_zero_sees_zero_without_state():
    x, base, delta, _ = random_conv_inputs(0)
    out = dynamic_conv_reference(mx.array(x), mx.array(base), mx.array(delta))
    want = (base[0] + np.repeat(delta[:, 0, 0], 16, axis=-1)) * x[:, 0]
    np.testing.assert_allclose(np.array(out[:, 0]), want, atol=1e-5)


@pytest.mark.skipif(not use_metal_kernel(), reason="needs an Apple GPU (mx.metal unavailable)")
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.float16, 2e-2), (mx.bfloat16, 8e-2)])
@pytest.mark.parametrize("with_state", [False, True])
def test_metal_kernel_agrees_with_reference(dtype, tol, with_state):
    x, base, delta, state = (mx.array(a).astype(dtype) for a in random_conv_inputs(1))
    st = state if with_state else None
    ref = dynamic_conv_reference(x, base, delta, st).astype(mx.float32)
    got = dynamic_conv_metal(x, base, delta, st).astype(mx.float32)
    assert mx.allclose(got, ref, atol=tol, rtol=tol).item()


SHIM = """
#include <cstdio>
#include <cstdlib>
#include <vector>
using uint = unsigned int;
struct uint3 { uint x, y, z; };

// The kernel body exactly as MLX receives it; template arguments become a typedef and
// constexprs at the top of the body, as mx.fast.metal_kernel generates them.
static void conv_kernel(const float* x, const float* base, const float* delta,
                        const float* state, float* out, uint3 thread_position_in_grid) {
    typedef float T;
    constexpr int TAPS = %(taps)d;
    constexpr int G = %(g)d;
    constexpr int L = %(L)d;
    constexpr int D = %(D)d;
    constexpr bool HAS_STATE = %(has_state)s;
%(source)s
}

static std::vector<float> read(const char* path, size_t n) {
    std::vector<float> v(n);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), sizeof(float), n, f) != n) std::exit(3);
    std::fclose(f);
    return v;
}

int main(int argc, char** argv) {
    const int B = %(B)d;
    auto x = read(argv[1], (size_t)B * %(L)d * %(D)d);
    auto base = read(argv[2], (size_t)%(taps)d * %(D)d);
    auto delta = read(argv[3], (size_t)B * %(L)d * %(taps)d * (%(D)d / %(g)d));
    auto state = read(argv[4], (size_t)B * %(D)d);
    std::vector<float> out((size_t)B * %(L)d * %(D)d, -12345.0f);
    // The launch grid (D, L, B): one call per thread position.
    for (uint z = 0; z < (uint)B; ++z)
        for (uint y = 0; y < %(L)du; ++y)
            for (uint xx = 0; xx < %(D)du; ++xx)
                conv_kernel(x.data(), base.data(), delta.data(), state.data(), out.data(),
                            uint3{xx, y, z});
    FILE* f = std::fopen(argv[5], "wb");
    std::fwrite(out.data(), sizeof(float), out.size(), f);
    std::fclose(f);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the kernel source")
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("shape", [(1, 16, 64), (2, 8, 32), (3, 5, 128)])
def test_metal_kernel_source_logic_matches_reference_under_a_cpp_shim(
    tmp_path: Path, shape, with_state
):
    """Compile the exact kernel body as C++ and run it over the grid: a typo fails here."""
    B, L, D = shape
    taps, g = 2, 16
    arrays = random_conv_inputs(7 + B, B, L, D, taps, g)
    names = ["x", "base", "delta", "state"]
    for name, a in zip(names, arrays):
        a.tofile(tmp_path / f"{name}.bin")
    src = SHIM % dict(
        taps=taps,
        g=g,
        L=L,
        D=D,
        B=B,
        has_state="true" if with_state else "false",
        source=CONV_KERNEL_SOURCE,
    )
    (tmp_path / "shim.cpp").write_text(src)
    exe = tmp_path / "shim"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-Werror=return-type",
            str(tmp_path / "shim.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
    )
    files = [str(tmp_path / f"{n}.bin") for n in names]
    subprocess.run([str(exe), *files, str(tmp_path / "out.bin")], check=True)
    got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(B, L, D)
    x, base, delta, state = (mx.array(a) for a in arrays)
    ref = dynamic_conv_reference(x, base, delta, state if with_state else None)
    np.testing.assert_allclose(got, np.array(ref), atol=1e-4)


# -- the selector ---------------------------------------------------------------------------


def brute_force_walk(sel: CandidateSelector, logits, hidden, anchor):
    """The walk from the formula, one candidate pair at a time."""
    A = np.array(sel.predecessor_codebook)
    Bc = np.array(sel.successor_codebook)
    H = np.array(sel.hidden_projection(hidden))
    U = np.array(logits)
    prev, out = anchor, []
    for t in range(U.shape[0]):
        cands = np.argsort(-U[t], kind="stable")[: sel.top_k]
        scores = [U[t, b] + float(np.sum(A[prev] * H[t] * Bc[b])) for b in cands]
        prev = int(cands[int(np.argmax(scores))])
        out.append(prev)
    return out


def random_selector(seed, vocab=40, rank=8, dim=32, k=5):
    mx.random.seed(seed)
    sel = CandidateSelector(vocab, rank, dim, k)
    sel.predecessor_codebook = mx.random.normal((vocab, rank))
    sel.successor_codebook = mx.random.normal((vocab, rank))
    return sel


@pytest.mark.parametrize("seed", range(5))
def test_greedy_walk_equals_brute_force(seed):
    sel = random_selector(seed)
    logits = mx.random.normal((6, 40)) * 3
    hidden = mx.random.normal((6, 32))
    tokens, q = selector_walk(sel, logits, hidden, mx.array([3]))
    assert q is None
    assert tokens.tolist() == brute_force_walk(sel, logits, hidden, 3)


def test_walk_follows_the_pair_term_not_the_per_slot_argmax():
    vocab, rank, dim = 8, 2, 2
    sel = CandidateSelector(vocab, rank, dim, top_k=3)
    sel.hidden_projection.weight = mx.eye(2)
    pred = np.zeros((vocab, rank), np.float32)
    succ = np.zeros((vocab, rank), np.float32)
    pred[5] = [4.0, 0.0]  # after the anchor 5, token 2 is strongly preferred ...
    succ[2] = [3.0, 0.0]
    sel.predecessor_codebook, sel.successor_codebook = mx.array(pred), mx.array(succ)
    logits = mx.array([[0, 1.0, 0.5, 0.2, -5, -5, -5, -5], [0, 0, 0, 0, 0, 0, 0, 0.0]])
    hidden = mx.array([[1.0, 0.0], [0.0, 0.0]])
    tokens, _ = selector_walk(sel, logits, hidden, mx.array([5]))
    assert mx.argmax(logits[0]).item() == 1
    assert tokens[0].item() == 2, "... although token 1 has the higher logit"


def test_sampled_walk_returns_q_on_token_ids():
    sel = random_selector(3)
    logits = mx.random.normal((4, 40)) * 2
    keys = mx.random.split(mx.random.key(0), 4)
    tokens, q = selector_walk(sel, logits, mx.random.normal((4, 32)), mx.array([1]), 0.8, keys)
    assert q.shape == (4, 40)
    assert mx.allclose(q.sum(-1), mx.ones(4), atol=1e-5).item()
    assert ((q > 0).sum(-1) <= 5).all().item()
    assert (q[mx.arange(4), tokens] > 0).all().item(), "each proposal has mass under its q"


# -- DFlash 2 drafts ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft2(models_dir):
    folder = models_dir / "draft2"
    if not folder.exists():
        build_draft(folder, draft_config(4, [1, 2], dflash2=True), seed=5)
    return load_draft(folder)


def test_dflash2_checkpoint_loads_with_its_fields(draft2):
    c = draft2.config
    assert c.is_dflash2 and (c.conv_kernel_size, c.conv_group_size) == (2, 16)
    assert draft2.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * 64 // 16, 64)
    names = dict(tree_flatten(draft2.parameters()))
    assert "candidate_selector.predecessor_codebook" in names
    assert draft2.conv_state == "zero"


def test_dflash2_weights_with_wrong_shapes_are_refused(models_dir, draft2, tmp_path):
    folder = tmp_path / "d2"
    shutil.copytree(models_dir / "draft2", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["selector_rank"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"predecessor_codebook"):
        load_draft(folder)


def test_identity_conv_and_zero_selector_propose_like_dflash1(target, draft2):
    model, _ = target
    cfg1 = draft_config(4, [1, 2])
    d1 = DFlashDraft(DraftConfig.from_dict(cfg1))
    names1 = dict(tree_flatten(d1.parameters()))
    d1.update(tree_unflatten([(k, v) for k, v in tree_flatten(draft2.parameters()) if k in names1]))
    d2 = DFlashDraft(draft2.config)
    d2.update(draft2.parameters())
    for layer in d2.layers:
        for conv in layer.convs():
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    sel = d2.candidate_selector
    sel.predecessor_codebook = mx.zeros_like(sel.predecessor_codebook)
    sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
    states = []
    for d in (d1, d2):
        states.append(Pair(model, d).draft_state())
        mx.random.seed(4)
        d.add_context(mx.random.normal((1, 12, 128)), states[-1])
    greedy = SamplingParams()
    for anchor in (3, 17, 200):
        a = mx.array([anchor])
        t1, _ = propose(d1, states[0], a, 16, 15, greedy, None)
        t2, _ = propose(d2, states[1], a, 16, 15, greedy, None)
        assert t1.tolist() == t2.tolist()


def test_conv_state_after_partial_full_and_no_acceptance(target, draft2):
    model, _ = target
    pair = Pair(model, draft2)
    draft2.conv_state = "carry"
    try:
        st = pair.draft_state()
        mx.random.seed(6)
        draft2.add_context(mx.random.normal((1, 9, 128)), st)
        rows = st.conv[3]  # layer 1's mlp_conv
        a = mx.array([7])
        propose(draft2, st, a, 16, 15, SamplingParams(), None)
        rows_in, rows_out = rows.last
        st.commit(3)  # partial acceptance: the row at block index 3
        assert mx.array_equal(rows.state[0], rows_in[:, 3]).item()
        assert mx.array_equal(rows.state[1], rows_out[:, 3]).item()
        propose(draft2, st, a, 16, 15, SamplingParams(), None)
        rows_in, _ = rows.last
        st.commit(0)  # full rejection: the anchor's row
        assert mx.array_equal(rows.state[0], rows_in[:, 0]).item()
        # The carried row changes what the next block computes at index 0.
        carried = draft2.block_logits(a, 16, None, st)
        st.commit(None)
        zeroed = draft2.block_logits(a, 16, None, st)
        assert not mx.allclose(carried, zeroed, atol=1e-4).item()
        fresh = draft2.make_state()  # a new prompt: zero again
        assert all(r.state == [None, None] for r in fresh.conv)
    finally:
        draft2.conv_state = "zero"


@pytest.mark.parametrize("conv_state", ["zero", "carry"])
@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
def test_greedy_dflash2_equals_target_greedy(target, draft2, width, conv_state):
    model, tok = target
    draft2.conv_state = conv_state
    try:
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            out = generate(model, draft2, tok, ids, max_tokens=30, verify_width=width)
            assert out.tokens == target_greedy(model, ids, 30), f"W={width} {conv_state}"
    finally:
        draft2.conv_state = "zero"


def test_dflash2_refuses_a_shorter_draft_block(target, draft2):
    model, tok = target
    with pytest.raises(ValueError, match="DFlash 2 draft always drafts its trained block"):
        generate(model, draft2, tok, "hi", max_tokens=4, verify_width=4, draft_block=8)


@pytest.fixture(scope="module")
def tiny_vocab_pair2():
    return build_tiny_vocab_pair(13, dflash2=True)


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampled_dflash2_matches_target_distribution(tiny_vocab_pair2):
    model, draft = tiny_vocab_pair2
    params = SamplingParams(temperature=1.0)
    counts, accepted = second_token_counts(model, draft, params, 2500)
    assert accepted > 100
    assert not chi_square_rejects(counts, exact_second_token(model, 1.0, 0, 1.0)), counts


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampling_test_detects_q_left_on_candidate_indices(tiny_vocab_pair2, monkeypatch):
    """Drop the candidate-index -> token-id mapping of q: the same test must fail."""
    model, draft = tiny_vocab_pair2
    real_walk = sampling.selector_walk

    def unmapped(sel, logits, hidden, anchor, temperature=0.0, keys=None):
        tokens, q = real_walk(sel, logits, hidden, anchor, temperature, keys)
        # q as the candidates' probabilities in candidate order, at ids 0..k-1
        vals = mx.sort(q, axis=-1)[:, ::-1][:, : sel.top_k]
        wrong = mx.concatenate([vals, mx.zeros((q.shape[0], q.shape[1] - sel.top_k))], -1)
        return tokens, wrong

    monkeypatch.setattr(sampling, "selector_walk", unmapped)
    counts, _ = second_token_counts(model, draft, SamplingParams(temperature=1.0), 2500)
    assert chi_square_rejects(counts, exact_second_token(model, 1.0, 0, 1.0))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_selector_walk_past_slot_1_keeps_the_joint_distribution(tiny_vocab_pair2, monkeypatch):
    """DFlash 2 at width 4: slots 2 and 3 are drawn from the walk's q (the pair term of
    their predecessor), each tested, with the bonus after; the joint distribution of the
    first five tokens must be the target's. With q left on candidate indices for slots
    after the first only, the same test must fail."""
    model, draft = tiny_vocab_pair2
    table = TableDraft(draft, greedy_table(model))
    counts, by_accepted = joint_counts(model, table, JOINT_PARAMS, 3000)
    assert min(by_accepted) > 50, f"every acceptance length must occur: {by_accepted}"
    exact = exact_joint(model, 1.0, 3, 1.0)
    assert not joint_rejects(counts, exact)

    real_walk = sampling.selector_walk

    def later_slots_unmapped(sel, logits, hidden, anchor, temperature=0.0, keys=None):
        tokens, q = real_walk(sel, logits, hidden, anchor, temperature, keys)
        k = sel.top_k
        vals = mx.sort(q, axis=-1)[:, ::-1][:, :k]
        wrong = mx.concatenate([vals, mx.zeros((q.shape[0], q.shape[1] - k))], -1)
        return tokens, mx.concatenate([q[:1], wrong[1:]])

    monkeypatch.setattr(sampling, "selector_walk", later_slots_unmapped)
    counts, _ = joint_counts(model, table, JOINT_PARAMS, 2000)
    assert joint_rejects(counts, exact), "a wrong q after slot 1 was not detected"
