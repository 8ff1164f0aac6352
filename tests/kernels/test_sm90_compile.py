"""Every Triton kernel of the project compiles for sm_90 (tests/kernels/sm90.py): the launches of a tiny bf16
model's prefill and decode through the Triton backend, of the paths a tiny model does not take (histogram align,
split-K, split MLA decode, segmented MLA prefill, MXFP4 experts), and, recorded without running them, of the
Kimi-Linear-48B decode shapes (its linears, norms, activation, MoE with the shared expert, MLA at its head dims), of
its KDA prefill in 16- and 32-row chunks, and of the product kernels for an fp32 model (exact fp32 products)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from shard_svc.ops import select_ops
from tests.engine.conftest import linear_config, random_model
from tests.kernels.conftest import ON_GPU, kernel_module
from tests.kernels.sm90 import SHARED_MEMORY_LIMIT, compile_all, recorded_launches
from tests.kernels.test_glu import glu_module
from tests.kernels.test_invariant_linear import module as invariant_module
from tests.kernels.test_linear import linear_module
from tests.kernels.test_mla_decode import make_decode_batch, mla_module
from tests.kernels.test_mla_prefill import make_prefill_batch, prefill_module
from tests.kernels.test_moe_experts import make_inputs, moe_module
from tests.kernels.test_moe_w4a16 import make_inputs as w4_inputs, w4_module

KERNEL_DIR = Path(__file__).resolve().parents[2] / "shard_svc" / "ops" / "triton"
BF16, F32 = torch.bfloat16, torch.float32
D, E, K, I_MOE, I_DENSE = 2304, 256, 8, 1024, 9216  # Kimi-Linear-48B


def all_kernels() -> set[str]:
    """Names of the @triton.jit functions named `_*_kernel` in shard_svc/ops/triton (launched from the host)."""
    names = set()
    for path in KERNEL_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and node.name.endswith("_kernel"):
                names.add(node.name)
    return names


def tiny_model_launches() -> None:
    """One prefill pass of two prompts (one with a cached prefix from an earlier pass) and two decode steps."""
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.model.kimi import pack_weights

    cfg, model = random_model(linear_config(), seed=0, dtype=BF16)
    pack_weights(model)
    engine = Engine(cfg, model, select_ops(torch.device("cpu"), "triton"), torch.device("cpu"),
                    EngineConfig(num_state_slots=4, num_kv_blocks=64, kv_block_size=4, prefill_token_budget=24))
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(1, 31)), greedy)
    engine.add_request("b", [5, 6, 7], greedy)
    for _ in range(4):
        engine.step()


def other_paths() -> None:
    moe = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(40, 64, 32, 6, 3, BF16)
    moe.moe_experts(x, weights, ids, w1, w3, w2, "situ", (4.0, 25.0), small_align_max=0)  # histogram align
    lin = linear_module()
    lin.skinny_linear(torch.randn(2, 256, dtype=BF16), torch.randn(32, 256, dtype=BF16),
                      lin.SkinnyConfig(block_n=16, block_k=32, splits=4))  # split-K and its reduction
    args = make_decode_batch([37, 5], 2, 16, 8, 16, 32, 4, BF16)
    mla_module().mla_decode(*args, 0.1, num_splits=3)
    args = make_prefill_batch([40, 0], [9, 30], 2, 16, 8, 16, 32, 4, BF16)
    prefill_module().mla_prefill(*args, 0.1, workspace_tokens=16)  # segments merged across launches
    x, weights, ids, packed, _ = w4_inputs(5, 64, 64, 4, 2, BF16)
    w4_module().moe_experts_w4a16(x, weights, ids, packed, "silu", (1.0, 1.0))


def decode_48b_launches() -> None:
    """Recorded only (not run): the 48B decode step's shapes at batch 1 and 16."""
    lin, norm, glu = linear_module(), kernel_module("norm", "_rms_norm_kernel"), glu_module()
    moe_shared = kernel_module("moe_shared", "composed")
    one = torch.empty(1, D, dtype=BF16)
    for n, k in ((12288, D), (288, D), (4096, 128), (D, 4096), (6720, D), (2 * I_DENSE, D), (D, I_DENSE),
                 (163840, D)):
        lin.skinny_linear(torch.empty(1, k, dtype=BF16), torch.empty(1, k, dtype=BF16).expand(n, k))
    norm.add_rms_norm(one, one, torch.empty(D, dtype=BF16), 1e-5)
    norm.gated_rms_norm(torch.empty(1, 32, 128, dtype=BF16), torch.empty(128, dtype=BF16),
                        torch.empty(1, 32, 128, dtype=BF16), 1e-5)
    glu.glu(*torch.empty(1, 2 * I_DENSE, dtype=BF16).split(I_DENSE, -1), "silu", (1.0, 1.0))
    experts = [torch.empty(1, I_MOE, D, dtype=BF16).expand(E, I_MOE, D) for _ in range(2)]
    down = torch.empty(1, D, I_MOE, dtype=BF16).expand(E, D, I_MOE)
    for t in (1, 16):
        x = torch.empty(t, D, dtype=BF16)
        ids = torch.arange(t * K).remainder(E).view(t, K)
        moe_shared.moe_experts_shared(x, torch.empty(t, K), ids, *experts, down, "silu", (1.0, 1.0),
                                      torch.empty(2 * I_MOE, D, dtype=BF16), torch.empty(D, I_MOE, dtype=BF16))
    args = make_decode_batch([4095] * 2, 32, 128, 64, 128, 512, 64, BF16)
    mla_module().mla_decode(*args, 0.1)
    kernel_module("mla_cache", "_mla_cache_write_kernel").mla_cache_write(
        args[2], torch.empty(2, 512, dtype=BF16), torch.empty(2, 64, dtype=BF16), torch.empty(512, dtype=BF16), 1e-6,
        torch.tensor([0, 1]))
    for ctx in (0, 4096):  # a prompt's first chunk pipelines two key tiles, a pass over a context three
        args = make_prefill_batch([ctx], [512], 32, 128, 64, 128, 512, 64, BF16)
        prefill_module().mla_prefill(*args, 0.1)
    inv = invariant_module()  # batch-invariant mode's linear, on the GPU's tiling, at a prefill's rows
    for n, k in ((12288, D), (D, 4096)):
        inv.invariant_linear(torch.empty(3712, k, dtype=BF16), torch.empty(1, k, dtype=BF16).expand(n, k),
                             inv.GPU_TILES)


def kda_prefill_48b_launches() -> None:
    """Recorded only: KDA prefill at the 48B head dims (K = V = 128) in the chunk sizes the H200 has not run yet, and
    K3's gate (one-reference block products always) and the levels alone at every chunk size, an intra kernel
    layout of one slice and one stage, and narrow walks."""
    from tests.kernels.test_kda_chunk import make_inputs as kda_inputs

    kda = kernel_module("kda_chunk", "_kda_chunk_intra_kernel")
    (q, k, v, f, bl, a_log, dt_bias), slots = kda_inputs([100, 28], 2, 128, 128, BF16, "plain")
    cu = torch.tensor([0, 100, 128])
    for chunk in (16, 32):
        pool = torch.zeros(7, 2, 128, 128)
        kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, pool, slots, cu, chunk=chunk)
    for chunk in (16, 32, 64):
        pool = torch.zeros(7, 2, 128, 128)
        kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, -5.0, pool, slots, cu, chunk=chunk)
        kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, pool, slots, cu, chunk=chunk, block_ref=False)
    for lb in (None, -5.0):  # one slice of every channel, one pipeline stage
        kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, lb, pool, slots, cu, chunk=16, intra_slice=128, intra_warps=2,
                        intra_stages=1)
    # Walk layouts, named: the CPU's 4 "SMs" (common.INTERPRETER_SMS) would pick another default than a GPU's. 32 x 1:
    # many packed sequences' default, 32 x 4: a lone sequence's, 64 x 4: a few packed ones'.
    for block_v, warps in ((16, 1), (32, 1), (32, 2), (32, 4), (64, 4)):
        kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, -5.0, pool, slots, cu, block_v=block_v, state_warps=warps)


def fp32_launches() -> None:
    """Recorded only: the kernels with matrix products, for a model computing in fp32, where their products are exact
    fp32 ("ieee", `common.dot_precision`) rather than the tensor cores' TF32."""
    from tests.kernels.test_kda_chunk import make_inputs as kda_inputs

    kda = kernel_module("kda_chunk", "_kda_chunk_intra_kernel")
    (q, k, v, f, bl, a_log, dt_bias), slots = kda_inputs([40, 9], 2, 32, 32, F32, "plain")
    kda.kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, torch.zeros(7, 2, 32, 32), slots, torch.tensor([0, 40, 49]))
    mla_module().mla_decode(*make_decode_batch([37, 5], 2, 16, 8, 16, 32, 4, F32), 0.1)
    prefill_module().mla_prefill(*make_prefill_batch([40, 0], [9, 30], 2, 16, 8, 16, 32, 4, F32), 0.1)
    x, weights, ids, packed, _ = w4_inputs(5, 64, 64, 4, 2, F32)
    w4_module().moe_experts_w4a16(x, weights, ids, packed, "silu", (1.0, 1.0))
    x, weights, ids, w1, w3, w2 = make_inputs(5, 64, 32, 6, 3, F32)
    moe_module().moe_experts(x, weights, ids, w1, w3, w2, "situ", (4.0, 25.0))
    linear_module().skinny_linear(torch.randn(2, 256), torch.randn(32, 256))
    inv = invariant_module()
    inv.invariant_linear(torch.empty(40, 256), torch.empty(32, 256), inv.GPU_TILES)


def every_launch() -> list[dict]:
    """The specs of every launch above: run (the tiny model, the other paths) or recorded only (48B shapes, fp32)."""
    with recorded_launches() as specs:
        tiny_model_launches()
        other_paths()
    with recorded_launches(execute=False) as specs_48b:
        decode_48b_launches()
        kda_prefill_48b_launches()
        fp32_launches()
    return specs + specs_48b


@pytest.mark.slow  # ~1 minute: out of `make test-fast`
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests compile every kernel for the card itself")
def test_every_kernel_compiles_for_sm90(tmp_path):
    specs = every_launch()
    results = compile_all(specs, str(tmp_path))
    assert len(results) == len(specs)
    failed = [f"{r['name']} {r['constexprs']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "kernels that do not compile for sm_90:\n" + "\n".join(failed)
    assert all(r["registers"] for r in results), "cuobjdump's resource usage no longer parses (tests/kernels/sm90.py)"
    too_big = [f"{r['name']} {r['constexprs']}: {r['shared']} B" for r in results if r["shared"] > SHARED_MEMORY_LIMIT]
    assert not too_big, f"more shared memory than an sm_90 block has ({SHARED_MEMORY_LIMIT} B):\n" + "\n".join(too_big)
    kda = kernel_module("kda_chunk", "_kda_chunk_intra_kernel")  # the intra kernel's default slices, by gate
    hot = [r for r in results if r["constexprs"].get("K") == 128 and r["constexprs"].get("BT") == 16 and (
        r["name"] == "_kda_chunk_intra_kernel" and r["constexprs"]["REF_MODE"] != 0
        and r["constexprs"]["BKS"] == (kda.SLICE_BOUNDED if r["constexprs"]["REF_MODE"] == 1 else kda.SLICE)
        and r["options"].get("num_warps") == 1
        or r["name"] == "_kda_chunk_state_kernel" and r["options"].get("num_warps") == 4)]  # the one-warp walk of
    # many packed sequences spills at sm_90 and still ran fastest (kda_chunk.kda_prefill_stages): not held to this
    assert len(hot) >= 4 and not [r for r in hot if r["stack"]], \
        f"KDA prefill at its default layouts (48B head dims) spills registers: {[r for r in hot if r['stack']]}"
    missing = all_kernels() - {r["name"] for r in results}
    assert not missing, f"kernels no recorded launch reached (add a call above): {sorted(missing)}"


def test_kernels_launched_with_pdl_wait_first():
    """A kernel launched with programmatic dependent launch may start while the previous kernel still writes: each
    kernel with a PDL parameter must open with `pdl_prologue(PDL)`, and every launch of it must pass `pdl_args(...)`
    (the constexpr and the launch attribute together), or it could read inputs that are not yet written."""
    with_pdl, launches = {}, []
    for path in KERNEL_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and any(a.arg == "PDL" for a in node.args.args)):
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                    node.body[0].value, ast.Constant) else node.body
                first = ast.unparse(body[0]) if body else ""
                with_pdl[node.name] = first
        for call in ast.walk(tree):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                    and isinstance(call.func.value, ast.Name)):
                launches.append((path.name, call.func.value.id, [ast.unparse(k.value) for k in call.keywords
                                                                 if k.arg is None]))
    assert len(with_pdl) >= 12, sorted(with_pdl)
    assert {name: first for name, first in with_pdl.items() if first != "pdl_prologue(PDL)"} == {}
    for file, kernel, spread in launches:
        if kernel in with_pdl:
            assert any(s.startswith("pdl_args(") for s in spread), f"{file}: {kernel} launched without pdl_args"
        else:
            assert not any(s.startswith("pdl_args(") for s in spread), f"{file}: {kernel} has no PDL prologue"


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    from shard_svc.ops.triton.common import pdl_args

    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_args(torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}


def test_every_matrix_product_names_its_precision():
    """Triton multiplies fp32 operands as TF32 unless told otherwise, which an fp32 model's eager reference does not
    (README, Trained models): every `tl.dot` passes `input_precision=PRECISION`, a constexpr its launch sets from
    `common.dot_precision`."""
    unnamed = []
    for path in KERNEL_DIR.glob("*.py"):
        for call in ast.walk(ast.parse(path.read_text())):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "dot"
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "tl"):
                precision = [k.value for k in call.keywords if k.arg == "input_precision"]
                if not (precision and isinstance(precision[0], ast.Name) and precision[0].id == "PRECISION"):
                    unnamed.append(f"{path.name}:{call.lineno}")
    assert not unnamed, f"tl.dot without input_precision=PRECISION: {unnamed}"
    launches = "".join(p.read_text() for p in KERNEL_DIR.glob("*.py"))
    assert launches.count("tl.dot(") >= 25 and "dot_precision(" in launches


def test_resident_programs_counts_hopper_register_allocation():
    """The report's occupancy column: registers are allocated per warp in units of 256 out of 65,536 per SM, and an
    SM holds at most 32 blocks."""
    from tests.kernels.sm90_report import resident_programs

    assert resident_programs(255, 1) == 8  # 255 x 32 = 8,160, rounded up to 8,192 a warp
    assert resident_programs(168, 1) == 12  # 5,376 a warp
    assert resident_programs(207, 1) == 9  # 6,624 -> 6,656 a warp
    assert resident_programs(32, 4) == 16
    assert resident_programs(16, 1) == 32  # 128 would fit by registers; the block limit holds


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests compile every kernel for the card itself")
def test_the_report_reads_the_sass_loops(tmp_path, monkeypatch):
    """sm90_report --sass: the skinny GEMM's K loop is found, with its matrix products, inside the kernel's count."""
    with recorded_launches() as specs:
        linear_module().skinny_linear(torch.randn(2, 256, dtype=BF16), torch.randn(32, 256, dtype=BF16))
    monkeypatch.setenv("SM90_SASS", "1")
    (result,) = compile_all(specs[:1], str(tmp_path))
    sass = result["sass"]
    assert result["name"] == "_skinny_kernel" and sass["instructions"] > 100, result
    assert sass["loops"] and all(0 < loop["instructions"] < sass["instructions"] for loop in sass["loops"]), sass
    assert any(loop.get("HMMA", 0) + loop.get("HGMMA", 0) > 0 for loop in sass["loops"]), sass
