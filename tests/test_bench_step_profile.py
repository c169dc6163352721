"""``python -m k3lab.bench.step_profile --small --device cpu``: the trainer's step profiled on a CPU in seconds,
its correctness check run, every phase and category present and summing to the step's time; the kernel-name
categories and the CUDA events' phase attribution on known names and a synthetic trace."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Kernel

from k3lab.bench.step_profile import CATEGORY_NAMES, PHASES, TOP_KERNELS, category, main, records, summarise

FIELDS = ("device", "commit", "date", "versions", "preset", "batch_size", "microbatches", "seq_len", "warmup",
          "tokens_per_step", "time_kind", "categories", "check", "steps", "mean", "top_kernels", "gemm_share",
          "flops_per_token", "flops_per_step", "tflops_per_s", "mfu", "unprofiled_step_ms", "flops_convention")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, one_thread):
    """(returned dict, written JSON) of one small CPU run (about 10 s)."""
    out = tmp_path_factory.mktemp("step_profile") / "step_profile.json"
    with one_thread():
        result = main(["--small", "--device", "cpu", "--out", str(out)])
    return result, json.loads(out.read_text())


def test_small_run_writes_the_fields(small_run):
    result, written = small_run
    assert set(FIELDS) <= set(written)
    assert written == json.loads(json.dumps(result))
    assert written["preset"] == "k3-tiny" and written["device"] == "cpu" and written["mfu"] is None
    assert [s["step"] for s in written["steps"]] == [2, 3]  # after one warm-up step
    assert written["flops_per_step"] == written["flops_per_token"] * written["tokens_per_step"] > 0
    check = written["check"]
    assert check["ok"] and check["weights_changed"] and 0 <= check["loss_max_rel_err"] <= check["loss_bound"]
    assert all(math.isfinite(s["loss"]) and 0 < s["loss"] < 20 for s in written["steps"])


def test_categories_and_phases_sum_to_the_device_time(small_run):
    written = small_run[1]
    for s in written["steps"] + [written["mean"]]:
        assert set(s["categories_ms"]) == set(CATEGORY_NAMES) and set(s["phases_ms"]) == set(PHASES)
        assert sum(s["categories_ms"].values()) == pytest.approx(s["device_ms"], rel=1e-9)
        assert sum(s["phases_ms"].values()) == pytest.approx(s["device_ms"], rel=1e-9)
        # Every phase of the trainer's step ran ops (k3-tiny has MoE layers: the bias update too).
        assert all(s["phases_ms"][p] > 0 for p in ("forward", "backward", "optimizer", "bias_update"))
        assert s["phases_ms"]["other"] < 0.01 * s["device_ms"]
        assert s["categories_ms"]["gemm"] > 0 and s["categories_ms"]["grouped_gemm"] > 0
    cats = written["mean"]["categories_ms"]
    assert written["gemm_share"] == pytest.approx((cats["gemm"] + cats["grouped_gemm"]) / written["mean"]["device_ms"])
    top = written["top_kernels"]
    assert 0 < len(top) <= TOP_KERNELS and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    assert all(k["category"] == category(k["name"]) and k["count"] >= 1 for k in top)


@pytest.mark.parametrize("name, expected", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal"
     "<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >", "grouped_gemm"),
    ("kda_state_fwd_kernel", "flash_kda"), ("short_conv_silu_bwd_kernel", "flash_kda"),
    ("attnres_phase1_bwd_kernel", "attnres"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4> >", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps>>", "reduction"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float>", "reduction"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy_cast"),
    ("Memcpy HtoD (Pageable -> Device)", "copy_cast"), ("Memset (Device)", "copy_cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, LerpFunctor<float>>", "elementwise"),
    ("triton_poi_fused_add_mul_sigmoid_0", "elementwise"), ("triton_red_fused_sum_1", "reduction"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "nccl"), ("glu_fwd_kernel", "elementwise"),
    ("aten::mm", "gemm"), ("aten::_grouped_mm", "grouped_gemm"), ("aten::mul", "elementwise"),
    ("aten::copy_", "copy_cast"), ("aten::sum", "reduction"), ("aten::_fused_rms_norm", "norm"),
    ("_Phase1Backward", "attnres"), ("aten::view", "other"), ("moonep_layout_kernel", "other"),
])
def test_category_table_on_known_names(name, expected):
    assert category(name) == expected


def _event(name, start, end, device=DeviceType.CPU, kind="cpu_op", kernels=()):
    # As torch builds them: device work listed under the host op that launched it (``kernels``); no
    # ``linked_correlation_id`` (FunctionEvent has none in torch 2.11).
    return SimpleNamespace(name=name, device_type=device, activity_type=kind, is_user_annotation="annotation" in kind,
                           kernels=[Kernel(k, 0, us) for k, us in kernels], self_cpu_time_total=end - start,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_cuda_kernels_go_to_the_phase_their_launching_op_started_in():
    # forward_backward [0, 100] holds forward [0, 40]; the backward's op runs on another thread at 60; the
    # range's device copy (under its annotation) and the runtime call are not device time.
    cuda = DeviceType.CUDA
    events = [_event("forward_backward", 0, 100, kind="user_annotation"),
              _event("forward", 0, 40, kind="user_annotation", kernels=[("forward", 40)]),
              _event("aten::mm", 10, 12, kernels=[("nvjet_fwd", 10)]),
              _event("MmBackward0", 60, 70, kernels=[("nvjet_bwd", 20)]),
              _event("optimizer", 110, 150, kind="user_annotation"),
              _event("aten::copy_", 120, 121, kernels=[("Memcpy DtoD (Device -> Device)", 5)]),
              _event("aten::zero_", 160, 161, kernels=[("Memset (Device)", 1)]),
              _event("cudaLaunchKernel", 10, 11, kind="cuda_runtime"),
              _event("forward", 5, 45, device=cuda, kind="gpu_user_annotation"),
              _event("nvjet_fwd", 20, 30, device=cuda, kind="kernel"),
              _event("nvjet_bwd", 80, 100, device=cuda, kind="kernel")]
    s = summarise(*records(SimpleNamespace(events=lambda: events), torch.device("cuda")))
    assert s["device_ms"] == pytest.approx(0.036)
    assert s["phases_ms"] == pytest.approx(dict(forward=0.010, backward=0.020, optimizer=0.005, bias_update=0.0,
                                                other=0.001))
    assert s["categories_ms"]["gemm"] == pytest.approx(0.030)
    assert s["categories_ms"]["copy_cast"] == pytest.approx(0.006)
    assert s["kernels"]["nvjet_bwd"] == [pytest.approx(0.020), 1, {"MmBackward0": pytest.approx(0.020)}]


def test_each_kernel_is_credited_to_its_op_after_the_backward_node_it_ran_under():
    node = _event("autograd::engine::evaluate_function: IndexSelectBackward0", 60, 70)
    node.cpu_parent = None
    add = _event("aten::index_add_", 61, 62, kernels=[("indexFuncLargeIndex", 7)])
    add.cpu_parent = SimpleNamespace(name="aten::index_put_", cpu_parent=node)
    mm = _event("aten::mm", 10, 12, kernels=[("nvjet", 3)])
    full = _event("Command Buffer Full", 63, 64, kernels=[("nvjet", 2)])
    full.cpu_parent = SimpleNamespace(name="aten::mm", cpu_parent=node)
    recs, _ = records(SimpleNamespace(events=lambda: [node, add, mm, full]), torch.device("cuda"))
    assert [r[3] for r in recs] == ["IndexSelectBackward0 > aten::index_add_", "aten::mm",
                                    "IndexSelectBackward0 > aten::mm"]
    s = summarise(recs, [])
    assert s["kernels"]["indexFuncLargeIndex"][2] == {"IndexSelectBackward0 > aten::index_add_": pytest.approx(0.007)}


@pytest.mark.parametrize("argv, message", [
    (["--small", "--device", "cpu", "--batch-size", "0"], "argument --batch-size: expected a positive int, got 0"),
    (["--small", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--small", "--device", "cpu", "--steps", "x"], "argument --steps: expected a positive int, got 'x'"),
    (["--small", "--device", "cpu", "--seq-len", "1"], "--seq-len must be an int >= 2, got 1"),
], ids=["batch-size", "device", "steps", "seq-len"])
def test_bad_flags_exit_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_without_small_is_refused_before_any_work():
    with pytest.raises(SystemExit, match="--device cpu needs --small"):
        main(["--device", "cpu"])


@pytest.mark.parametrize("broken", ["no_update", "loss_off"])
def test_the_check_fails_when_the_step_is_wrong(broken, monkeypatch, one_thread):
    # A step that leaves the weights as they were, or whose loss is not the model's on that batch, stops the
    # benchmark before its numbers are reported.
    import k3lab.bench.step_profile as sp

    if broken == "no_update":
        monkeypatch.setattr(sp, "optimizer_step", lambda opts, *a: [o.zero_grad(set_to_none=True) for o in opts])
    else:
        fb = sp.forward_backward
        monkeypatch.setattr(sp, "forward_backward", lambda *a: fb(*a) * 1.05)
    with one_thread(), pytest.raises(AssertionError, match="vs eager float32"):
        main(["--small", "--device", "cpu", "--steps", "1", "--seq-len", "16", "--out", ""])
