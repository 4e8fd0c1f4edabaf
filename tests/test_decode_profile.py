"""`megatron-cp-bench decode --model --profile` (bench/decode_profile.py): the kernel-name table on names real CUDA
runs report, the step accounting on a synthetic GPU trace (marker kernels, overlapping streams, gaps), and the
whole profile of a tiny model's eager step on the CPU, one rank and two (gloo)."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.bench.decode_profile import (CATEGORIES, TOTALS, classify, classify_all, steps_of,
                                                     summarize)

# Names as CUPTI / the profiler report them (H100 / H200 runs, torch 2.x, Triton 3, NCCL 2.2x), and the
# outermost CPU ops of the eager step on the CPU.
REAL_NAMES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched"
    "<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(cublasGemvParamsEx<int, "
    "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
    "cublasGemvTensorStridedBatched<__nv_bfloat16>, float>, float, float)": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8::Params)": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, false, "
    "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, "
    "float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::"
    "bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, false, "
    "true, false, false>(Flash_fwd_params)": "attention",
    "void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::"
    "bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, 4, 1, true>(Flash_fwd_params)":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "_partial_kernel": "attention",                              # kernels/flash_decode.py (Triton: the function's name)
    "_deft_partial_kernel": "attention",
    "_rope_append_kernel": "rope_append",                        # kernels/rope_append.py
    "triton_poi_fused_apply_rotary_pos_emb_cat_mul_0": "rope_append",
    "void at::native::vectorized_elementwise_kernel<4, at::native::cos_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, "
    "2ul> >(int, at::native::cos_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::"
    "{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)": "rope_append",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_copy_kernel_"
    "impl<long>(at::TensorIterator&, long, long, long)::{lambda(char*, char const*, long)#1}>": "rope_append",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "exchange",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "exchange",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "exchange",
    "_merge_kernel": "merge",                                    # the tree merge (kernels/flash_decode.merge_packed)
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::logaddexp_kernel_cuda"
    "(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float, "
    "float)#1}, std::array<char*, 3ul> >(int, float, std::array<char*, 3ul>)": "merge",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(int, float, "
    "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)": "norm",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4>)": "norm",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "sampling",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::bfloat16_copy_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul>)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<4u>, "
    "unsigned int, 1, 128, 1>(...)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::"
    "native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)"
    "#1}, std::array<char*, 2ul> >(int, c10::BFloat16, std::array<char*, 2ul>)": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, "
    "3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)": "other",
    "void at::native::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>(at::cuda::detail::"
    "TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16 const, unsigned int>, "
    "at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, unsigned int, long)": "other",
    "_peer_merge_kernel": "exchange",          # tree_decode "peer": the exchange and merge in one kernel
    # CPU (the eager step's outermost ops)
    "LinearWithGradAccumulationAndAsyncCommunication": "gemm",
    "aten::linear": "gemm",
    "aten::einsum": "attention",
    "aten::rms_norm": "norm",
    "aten::index_copy_": "rope_append",
    "c10d::_allgather_base_": "exchange",
    "aten::argmax": "sampling",
    "aten::copy_": "copy",
    "aten::add": "other",
    "aten::gelu": "other",
}


@pytest.mark.parametrize("name", REAL_NAMES)
def test_the_kernel_table_puts_each_real_kernel_in_its_part(name):
    assert classify(name) == REAL_NAMES[name], name


def test_a_pattern_inside_another_word_does_not_match():
    # "rope" in "property", "allreduce" in "smallReduce": whole-word patterns only where a name could hide them.
    assert classify("void at::native::property_kernel<float>(float*)") == "other"
    assert classify("void at::native::smallReduce_kernel<float>(float*)") == "other"


def test_a_merge_right_after_the_attention_kernel_is_its_split_kv_combine():
    layer = ["_partial_kernel", "_merge_kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
             "_merge_kernel", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"]
    assert classify_all(layer) == ["attention", "attention", "exchange", "merge", "gemm"]
    assert classify_all(["_merge_kernel"]) == ["merge"]
    assert classify_all(["_partial_kernel", "_merge_kernel", "_peer_merge_kernel", "_gemv_kernel"]) == [
        "attention", "attention", "exchange", "gemm"]


def _k(name, ts, dur, device=0, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device}}


def test_gpu_steps_are_the_kernels_between_markers_and_idle_is_wall_less_their_union():
    # Two steps between three marker kernels (spin_kernel, 1 us each); a memset on another stream overlaps the
    # NCCL kernel; a kernel of another GPU and one before the first marker (the warm-up) do not count.
    ev = [_k("nvjet_tst_warmup", 0, 50), _k("spin_kernel(long)", 100, 1),
          _k("nvjet_tst_a", 101, 40), _k("_partial_kernel", 150, 20), _k("_merge_kernel", 170, 5),
          _k("ncclDevKernel_AllGather_RING_LL(x)", 175, 18), _k("Memset (Device)", 180, 2, cat="gpu_memset"),
          _k("_merge_kernel", 195, 5), _k("nvjet_tst_other_gpu", 120, 50, device=1),
          _k("spin_kernel(long)", 301, 1),
          _k("nvjet_tst_a", 302, 40), _k("weird_kernel", 350, 10),
          _k("spin_kernel(long)", 402, 1)]
    steps = steps_of(ev, 0)
    assert [(lo, hi, len(e)) for lo, hi, e in steps] == [(101, 301, 6), (302, 402, 2)]
    p = summarize(steps)
    assert set(p) == set(CATEGORIES + TOTALS)
    assert p["wall"] == (150.0, 4.0)                              # (200 + 100) / 2 us, (6 + 2) / 2 kernels
    assert p["gemm"] == (40.0, 1.0) and p["attention"] == (12.5, 1.0) and p["exchange"] == (9.0, 0.5)
    assert p["merge"] == (2.5, 0.5) and p["copy"] == (1.0, 0.5) and p["other"] == (5.0, 0.5)
    # busy: step 1 [101, 141) + [150, 193) + [195, 200) = 88 (the memset inside the NCCL kernel), step 2 40 + 10
    assert p["busy"][0] == pytest.approx(69.0) and p["idle"][0] == pytest.approx(81.0)
    assert sum(p[c][0] for c in CATEGORIES) == pytest.approx(70.0)   # > busy: the memset overlapped
    with pytest.raises(ValueError, match="no measured step"):
        summarize(steps_of(ev[:1], 0))


def _profile(rank, world, argv):
    from megatron_cp_plugin.bench.decode import parser
    from megatron_cp_plugin.bench.decode_profile import profile_bench

    a = parser().parse_args(argv)
    a.model = True
    return profile_bench(a, rank, world, torch.device("cpu"), None)


TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--ffn", "128",
        "--dtype", "fp32", "--batch", "1", "--decoders", "tree", "--context", "128", "--eager-context", "128",
        "--profile", "--profile-steps", "3"]


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_profile_of_a_tiny_model_accounts_for_every_part_of_the_step(pools, tmp_path, world):
    out = tmp_path / "prof"
    rows = pools(world).run(_profile, [*TINY, "--out", str(out)])[0]
    assert [r["not_run"] for r in rows if "not_run" in r] == ["not run: a CUDA graph needs a GPU (this run is on "
                                                             "the CPU)"]
    ran = [r for r in rows if "part" in r]
    assert not [r for r in rows if "error" in r], rows
    for rank in range(world):
        by = {r["part"]: r for r in ran if r["rank"] == rank}
        assert list(by) == list(CATEGORIES + TOTALS) and len(ran) == world * len(by)
        assert abs(by["busy"]["us"] + by["idle"]["us"] - by["wall"]["us"]) <= 1      # within the rounding
        assert 0 < by["busy"]["us"] <= by["wall"]["us"] and by["idle"]["us"] >= 0
        assert abs(by["busy"]["us"] - sum(by[c]["us"] for c in CATEGORIES)) <= 5   # one thread: no overlap
        # Per step: 2 layers x 4 linear layers + the output layer, one argmax, one RMSNorm per norm (2 x 2 + 1),
        # every layer's K, V appended (index_copy_).
        assert (by["gemm"]["n"], by["sampling"]["n"], by["norm"]["n"]) == (9, 1, 5)
        assert by["rope_append"]["n"] >= 2 and by["attention"]["n"] >= 2 and by["gemm"]["us"] > 0
        assert (by["exchange"]["n"] > 0) == (world > 1) and (by["exchange"]["must_read_MB"] > 0) == (world > 1)
        # Bytes: the linear layers' weights and biases (fp32: qkv 64 -> (4 + 2 x 2) x 64, proj 4 x 64 -> 64, fc1,
        # fc2, the output layer; at P > 1 a rank's share of the split MLPs: fc1's weight and bias, fc2's weight), this
        # rank's KV shard (2 layers, K and V, 2 KV heads, d 64, fp32: 2 KiB a token) of ceil((128 + 3 warm-up + 1) /
        # P) tokens, fp32 logits of 257 tokens.
        qkv, proj, fc1, fc2 = 64 * 512 + 512, 256 * 64 + 64, 64 * 128 + 128, 128 * 64 + 64
        linear = (2 * (qkv + proj + (fc1 + fc2 - 64) / world + 64) + 257 * 64) * 4
        assert by["gemm"]["must_read_MB"] * 1e6 == pytest.approx(linear)
        assert by["attention"]["must_read_MB"] * 1e6 == pytest.approx(-(-132 // world) * 2048)
        assert by["sampling"]["must_read_MB"] * 1e6 == 257 * 4 and by["copy"]["must_read_MB"] == ""
        assert by["gemm"]["GBps"] == pytest.approx(by["gemm"]["must_read_MB"] / by["gemm"]["us"] * 1e3, rel=0.01)
        assert by["wall"]["events_ms"] > 0
    assert (out.with_suffix(".md")).read_text().count("| wall |") == world
    assert sorted(p.name for p in (tmp_path / "prof_traces").iterdir()) == [
        f"128_b1_tree_eager_rank{r}.json.gz" for r in range(world)]
