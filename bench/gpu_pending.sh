#!/usr/bin/env bash
# The GPU checks still pending (bench/NOTES.md), in priority order, each in its own process
# with its own time limit (a CUDA_ERROR_ILLEGAL_* poisons the process that hit it, and an
# mbarrier or named-barrier deadlock hangs it). Parts, each one device call of under 10 minutes
# (the machine idles back after 30 s, so run them back to back):
#   PART=s7      Hopper attention: GPU tests (persistent and 128 x 128 overlapped configs too),
#                the attention config grid over issue 7's shapes
#   PART=s8      what session 7 left: the attention op's GPU tests on the TMA default, the
#                clocks/power probe with it
#   PART=s8s     the TMA attention kernel's schedules: the GPU tests of ping-pong and the producer
#                warpgroup, then the A/B of the four schedules over issue 7's shapes
#   PART=s8d     after the d128 default became ping-pong + producer: the op's GPU tests, the
#                attention benchmarks, the d64 schedules with 64- and 128-key blocks
#   PART=s8e     after max.NaN.f32 in the fragment reductions and deferred row sums: the GPU tests
#                of fmax_nan, the reductions and the Hopper attention, the attention
#                benchmarks, the clocks probe
#   PART=s8f     three consumer warpgroups (block_m 192): the GPU schedule tests, the d64 A/B
#   PART=s8g     the d64 default at 192 x 128: the op's GPU tests, the attention benchmarks
#   PART=s8h     after the 32-bit causal mask compares: the Hopper schedules' GPU tests, the
#                attention benchmarks (the session's final table)
#   PART=s9      after the session-9 changes (one wgmma descriptor per operand advanced by 32-bit
#                adds, the warpgroup index warp-uniform, causal per-warpgroup key bounds): the
#                GPU tests of wgmma, TMA, the Hopper attention and GEMM, the attention benchmarks
#   PART=s9l     lazy rescaling in the Hopper attention: its GPU tests and the online softmax's,
#                the attention benchmarks
#   PART=s9t     the session-9 GPU tests, one process per file: the Hopper attention kernel, the
#                online softmax, the attention op, the warp-specialised TMA GEMM
#   PART=s11a    GEMM clusters of two (B multicast): cluster PTX + TMA GEMM GPU tests, the A/B
#                against the one-block configs (--cluster --quick --rounds 3)
#   PART=s11e    the GEMM op's GPU tests on the new default, the cluster GPU tests
#   PART=s24a    head dims past 128 and not multiples of 64 on the TMA attention kernels (issue
#                25): the Hopper attention GPU tests, the backward's at 200 / 256, the key-block
#                A/B at 96 / 192 / 256, the attention forward benchmark
#   PART=s25a    what session 24 left: head_dim_v's GPU tests with the persistent default (128 /
#                64 causal), the backward past 128 after its 32 x 32 blocks, the attention op's
#                GPU tests (after the one TMA tile loader)
#   PART=s25b    split-K in the warp-specialised GEMM (issue 27): its GPU tests, the sweep of tile
#                shapes x splits over the issue's shape grid against cuBLAS (CUDA-graph replays)
#   PART=s25c    split-K after its written-out reduction, the memset zeroing: GPU tests, CUDA-graph
#                captures (split-K, attention's persistent counter), the shape-grid benchmark
#   PART=s25d    where a small GEMM's time goes (torch.profiler: kernels and graph nodes per call),
#                the split-K GPU tests s25c's time limit cut off, the split-K capture
#   PART=s25e    the model-based small-GEMM rule and captures reading settled tensor maps: the shape
#                grid benchmark, the CUDA-graph tests, the GEMM op's GPU tests, split-K's same
#                bits, the small-GEMM profile again
#   PART=s25f    s25e cut to the device time left after its machine was taken back: the shape grid
#                benchmark, the CUDA-graph tests, the GEMM op's GPU tests
#   PART=s25s    the d256 key-block A/B
#   PART=s31a    what s26a left (never run): the 8-bit rs wgmma's GPU test, the FP8 attention
#                GPU tests and CUDA-graph tests, its benchmark against tilepy's bf16 attention;
#                then the FP8 GEMM's GPU tests again (the N = 1424 case of s28a's mend)
#   PART=s32a    the backward's variants and block masks on the wgmma kernels (issue 25): the
#                backward GPU tests (window / soft cap autograd now on wgmma), the block-mask
#                GPU tests, the variants benchmark (window, soft cap, ALiBi against the mma.sync
#                kernels and FlexAttention)
#   PART=s32c    s32a's backward GPU tests stopping at the first failure (traceback), the
#                variants benchmark again (FlexAttention's score_mod without a captured tensor)
#   PART=s32d    GEMM's wave-aware tile choice (issue 27: 128 x 128 where 128 x 256 leaves the
#                last wave mostly empty): the op's GPU tests, the shape grid against cuBLAS; the
#                backward variants benchmark again (FlexAttention without donated buffers)
#   PART=s38a    the forward reading a block mask's bitmap on its partial blocks (issue 25): the
#                block-mask GPU tests, the document-mask benchmark cases (the mask function and
#                a mask that reads nothing timed beside)
#   PART=s38b    the mask_mod / block-mask forward cases with the bitmap (the persistent kernel
#                timed beside: is SPARSE_PERSISTENT worth turning on now), the document block
#                mask's backward with a mask that reads nothing timed beside (what the mask
#                costs the backward)
#   PART=s38c    the block-sparse backward reading the bitmaps, its warp-specialised kernel with
#                the producer's step words and count (issue 25): the block-mask GPU tests, the
#                backward user-functions benchmark (causal / window mask_mod run block-sparse
#                on the op's own mask: the spill fixes apply; the document mask with the
#                function, the deterministic pair and the dense register split timed beside)
#   PART=s39a    the swapped-operand GEMM of few rows (issue 27, WsConfig(swap_ab=True)): its GPU
#                test through the op, the shape grid's rows 1, 16 and 64 with the swapped
#                kernel and the one-wave configs timed beside (gemm.SWAP_SMALL_M flipped)
#   PART=s39b    the swapped-operand configs swept (bench/sweep_gemm_grid.py --swapped: tiles of
#                64 / 128 columns, stages, split-K 1 … 8, the op's choice beside) at rows 1, 16,
#                32 over the grid's (N, K), and with a column-major B (a linear layer's weight)
#   PART=s39c    the swapped-operand GEMM as the op's default at rows ≤ 32 (128-column tiles,
#                one item an SM): its GPU test, then the whole shape grid (issue 27's table;
#                rows ≤ 256 also time the kernel with the tensor maps prefetched at entry)
#   PART=s39d    the swapped configs swept at 64 rows (bench/sweep_gemm_grid.py --swapped --ms 64):
#                whether the op's rule should reach past 32 rows
#   PART=s39e    the swapped-operand GEMM's phases (bench/trace_gemm.py: the op's config at rows
#                1 and 16 is the swapped one): where its 1–3 µs over cuBLAS go
#   PART=s39f    issue 25's short-sequence forward shapes against cuDNN (B16 H16 S512 D64, B4 H32
#                S1024 D128, B8 H16 S2048 D64, GQA 32/8 S4096 D128; causal and not)
#   PART=s40a    s39f, then the short-sequence shapes' configs swept against cuDNN
#                (bench/sweep_attention.py --short-ab: tile shapes, grid and persistent,
#                ping-pong on and off): whether these shapes want another built-in config
#   PART=s40b    s40a's sweep alone (the device time left)
#   PART=s40c    the backward with v's head dim other than q's (192 / 128) GPU test, then
#                s40a's sweep at head_dim 64 only (B16 H16 S512, B8 H16 S2048)
#   PART=s40d    s40a's sweep at head_dim 128 only (B4 H32 S1024, GQA 32/8 S4096)
#   PART=s40e    the S1024 D128 and S512 D64 sweeps again, three rounds each (A, B, A, B, …)
#   PART=s40f    the swapped GEMM's GPU test; the shape grid's 1 and 16 × 4096 × 4096
#   PART=s41a    the ping-pong consumers (issue 27's large shapes: WsConfig(pingpong=True), a
#                tile a consumer): its GPU test, the --large sweep with the ping-pong
#                candidates at 4096 rows over three (N, K), at 8192³ and at 2048³
#   PART=s41b    packed sequences after v's own head dim, the window-alone fix and the wgmma
#                backward: the varlen GPU tests (a window alone at 192 / 128 against SDPA with
#                an explicit mask; the backward's against SDPA now on the wgmma pair)
#   PART=s41c    the wgmma backward at head dims between its tile widths (40 … 128, zero-filled):
#                the head-dim GPU tests (96 and 72 / 120 / 40 now on wgmma), the padded head
#                dims' backward benchmark (96 and 80: wgmma against mma.sync and cuDNN); the
#                packed sequences' backward benchmark (now the wgmma pair on sm_90)
#   PART=s41e    s41c with s41b's varlen GPU tests between its GPU tests and its benchmarks
#   PART=s45a    the backward's causal key blocks heaviest first (WgmmaBackwardConfig.heavy_first)
#                and the wide kernel's products narrowed to a head dim's own columns: the
#                backward GPU tests (SDPA float32 cases, the wide head dims with 192), the
#                probe's order A/B (heavy, plain, heavy, plain) at D256 causal, the probe at D192
#   PART=s45b    the backward benchmark against cuDNN / FA2: D256 and D192 full and causal, D128
#                S4096 causal
#   PART=s45c    the probe's order A/B on the d128 fused kernel (causal)
#   PART=s46a    the backward GPU tests after heavy-first / narrowed wide products (SDPA float32
#                cases, wide head dims) and the packed sequences' backward GPU test (its
#                warp-specialised producer now in 40 registers), and v's head dim other than
#                q's (192 / 128) on the wgmma kernels; the FP8 GEMM into a transposed out
#   PART=s46b    s45a's probes (order A/B at D256 causal, D192) and the varlen backward benchmark
#   PART=s46c    the backward benchmark of v's head dim 128 beside 192 (wgmma against the
#                mma.sync kernels), s45c's order A/B on the d128 fused kernel
#   PART=s45d    s45a slimmed to little device time: the wide head dims' GPU tests only, then
#                s45a's probes
#   PART=s44a    issue 25: packed sequences' backward on the warp-specialised kernel (dQ by
#                bulk reductions into per-sequence 64-row blocks) against deterministic=True
#                (dQ's own kernel) and the fixed-length backward; the backward past head_dim
#                128 (WGMMA_WIDE on) at D256 / D192 against cuDNN and FA2
#   PART=s44e    issue 25's wide head dims forward (D96 / D192 / D256 bf16 S4096) against cuDNN
#   PART=s44d    issue 25: packed sequences' backward on the fused kernel (the default past
#                head_dim 128, a config at 128): its GPU test against SDPA per sequence
#   PART=s43a    issue 25's backward past head_dim 128 on wgmma (split_columns, whole scores
#                and query halves): its GPU test (both forms), then the backward probe at
#                D256 (full, causal) and D192 against cuDNN / FA2 and the mma.sync kernels;
#                if the halves pass and beat the mma.sync kernels, turn
#                attention_backward.WGMMA_WIDE on
#   PART=s42a    the FP8 GEMM with block scales after its loop change (two k steps issued, the
#                first promoted under the second: no wgmma serialised): its GPU tests, the
#                probe at 4096³ / 8192³ against _scaled_mm, the loaded kernels' registers and
#                local memory with their machine code (probe_runtime_ptxas.py --launched)
#   PART=s42b    issue 25's short causal sequences on 64 x 64 tiles by default (seq_q <= 512):
#                the GPU test against SDPA, then s39f's short-sequence shapes against cuDNN
#   PART=s42c    the 32-bit tile walk (tile.schedule.udiv, no range with a run-time step) and
#                the FP8 block loop against the tree before them (ab_commits.py, two rounds,
#                gemm / attention / fp8): needs .ab/old (git archive 73e078c tilepy | tar -x
#                -C .ab/old) carried with the call
#   PART=s41d    issue 25's short sequences with 64-row tiles of one warpgroup (several blocks
#                an SM): the --short-ab sweep at S512 D64 and S1024 D128, two rounds each
#   PART=s39g    s39c slimmed to the device time left: the swapped GEMM's GPU test, the grid's
#                rows 1 and 16 (the points the swapped default changed), then s39e's trace
#   PART=s39h    s39g without the trace
#   PART=s38d    s38c slimmed to the device time left: the block-sparse backward's GPU test and the
#                document mask's backward benchmark
#   PART=s37a    block-sparse attention (issue 25): the block-mask GPU tests, the mask_mod /
#                block-mask benchmark cases against FlexAttention with the other TMA kernel
#                (persistent; grid when SPARSE_PERSISTENT is on) timed beside, the document mask
#                with `&` and with `and`
#   PART=s37b    the GEMM as a programmatic dependent launch and split-K reduced in a cluster
#                (issue 27): their GPU tests (a chain of split-K calls, eager and in a graph;
#                the same bits every run), the shape grid with each flag flipped timed beside
#   PART=s37c    s36d's FP8 attention benchmark (fma_exp_every 0 / 2 / 3) alone
#   PART=s37d    the PDL GEMM with its trigger late (after the last loads and main loops) beside
#                early: the shape grid alone
#   PART=s36a    the decoding kernel merging its own splits (the last split of a row tile, no
#                combine kernel) and gathering 16-key pages into 32-key blocks (issue 26): the
#                KV-cache GPU tests, the decoding benchmark (the combine kernel in blocks of
#                four and eight warps timed beside it); the FP8 attention benchmark with every
#                other tile's exponentials on the FMA pipe (fma_exp_every=2) beside the
#                default, its GPU tests (and exp2_fma's)
#   PART=s36d    s36a's FP8 attention benchmark with room (it ran past 140 s), the grouped GEMM's
#                one-launch gradient in b
#   PART=s36e    s36d's FP8 benchmark alone
#   PART=s36c    the decoding phase trace at the 134 MB shapes; the grouped GEMM's one-launch
#                gradient in b against the per-group calls and a cuBLAS loop; the host cost
#                per call (the decoding call now one launch where its splits merge themselves)
#   PART=s36b    Nsight of the FP8 GEMM with block scales (the 0.75-0.81x case; 128-column tiles:
#                block scales take block_n <= 128 — s37 ran it with 256 and got a refusal)
#   PART=s35e    s35d without s32f (little device time left), with the grouped GEMM's GPU tests
#                (the one-launch gradient in b captured in a graph)
#   PART=s35d    the combine kernel with up to eight warps a row (B1's 64 splits in two steps a
#                warp): KV-cache GPU tests, the decoding benchmark; then s32f
#   PART=s35c    the decoding combine kernel with a warp (or a few) a row, not a block (issue 26:
#                s35b's trace put q4's loss there): KV-cache GPU tests, the decoding
#                benchmark at every shape, the trace again
#   PART=s35b    the FP8 attention after V's transpose by words (GPU tests, the benchmark against
#                bf16), the decoding kernel traced at q1 and q4 (B8 S4096, paged-16 B64 S4096:
#                why q4 runs 20 % slower), the host-cost profiles, Nsight of the FP8 GEMM
#   PART=s35a    the grouped GEMM with a row-major b on the Hopper kernel by default (the
#                benchmark's "b row-major"), the host-cost profiles s34b lost, then s28c's
#                Nsight Compute of the FP8 GEMM and the FP8 attention
#   PART=s34b    what session 34 left: the host cost per call with cProfiles of the decoding,
#                attention and grouped calls (where their as-called time goes), the
#                decoding benchmark at q1 and q4 after the split rule; the grouped GEMM with a
#                row-major b on the Hopper kernel (GPU tests, the benchmark's "b row-major")
#                (every shape; paged-16 B64 S131072 moved 3 -> 17 splits), the backward
#                variants benchmark with room (s32e's 150 s step ended before its JSON)
#   PART=s34a    the grouped kernel's raster within each group and its TMA-store default (GPU
#                tests, the grouped benchmark), split-K calls of one capture sharing a workspace
#                (the CUDA-graph split-K tests), the decoding split rule and even runs (the
#                KV-cache GPU tests, the 134 MB contiguous benchmark case)
#   PART=s33a    issue 29 on a two-GPU machine (kind nvidia-h100-x2 / nvidia-h200-x2; NVLink
#                multicast off): the two-GPU tests, every op with its inputs on the other GPU
#                (bench/multi_gpu.py devices, both directions), the tensor-parallel block over
#                NCCL (torchrun, 2 ranks: errors, graph replay, step time on one and two GPUs)
#   PART=s33d    issue 26: the decoding split path's combine kernel as a programmatic dependent
#                launch (attention_kvcache.PDL): the KV-cache GPU tests (a PDL case captured
#                in a graph too), the decoding benchmark timing both
#   PART=s33b    one GPU after tilepy.devices (it touches every op; run first): the PyTorch,
#                CUDA-graph, GEMM, attention, KV-cache and softmax GPU tests, the host cost
#                per call (bench/overhead.py, grouped_gemm's replay beside torch._grouped_mm)
#   PART=s33c    issue 27: the grouped GEMM with the TMA-store epilogue (its GPU tests with
#                and without, the grouped benchmark with both beside torch._grouped_mm); small
#                M with 64 x 64 tiles (half the splits for the same items):
#                bench/sweep_gemm_grid.py at M 1, 16, 64 over the grid's (N, K), beside cuBLAS
#   PART=s32e    what session 32 left unmeasured (no device time): the backward GPU tests and
#                the block-mask ones after the soft cap's float16 derivative pairs, the chain
#                skipped for ALiBi / masks and the window mask on crossed blocks only; the
#                grid's two shapes the wave rule moves (and 2048 x 14336 x 4096 it keeps); the
#                backward variants benchmark (FlexAttention's score_mod backward mended)
#   PART=s32f    the backward of the user functions (score_mod with score_mod_grad, mask_mod,
#                a block mask) against the built-in arguments and FlexAttention's backward
#   PART=s32b    the block-mask backward benchmark against FlexAttention, and the dense
#                backward at B4 H32 S4096 D128 (the refactored wgmma kernels' plain path)
#   PART=s31b    issue 27's shapes whose 128 x 256 tiles leave the last wave part empty: the
#                persistent tile shapes (bench/sweep_gemm_grid.py --large) over M 256 … 4096
#                and 2048^3, beside cuBLAS
#   PART=s29a    where a launch's time goes, from the traced kernels' phase marks: the
#                warp-specialised GEMM (issue 27; its GPU test, bench/trace_gemm.py per shape
#                beside cuBLAS) and the decoding kernel (issue 26; bench/trace_decode.py beside
#                a device copy); then s28a (the FP8 GEMM's TMA-store epilogue)
#   PART=s28a    the FP8 GEMM's TMA-store epilogue (issue 28): its GPU tests, the probe of the
#                configs with and without it against torch._scaled_mm (run first; then s26b)
#   PART=s28c    Nsight Compute of the FP8 GEMM (with and without the TMA-store epilogue:
#                `--configs` of bench/profile_gemm_fp8.py) and of the FP8 attention against
#                tilepy's bf16 (bench/profile_attention.py --fp8)
#   PART=s28b    the block-sparse backward (issue 25): the block-mask and backward GPU tests,
#                the document-mask backward benchmark against the dense walk and FlexAttention
#   PART=s27     block masks (issue 25): the block-sparse kernels' GPU test (document masking
#                by a block mask against SDPA, causal as mask_mod against causal=True), the
#                user-function benchmark with the block-mask cases (causal and a window as
#                mask_mod against the built-in arguments and compiled FlexAttention, document
#                masking with its block mask); packed sequences on the grid TMA kernel (the
#                varlen GPU tests and benchmark); then what s26a and s26b left. s27a: its GPU
#                tests and the varlen benchmark, s27b: the user-function benchmark (one call each)
#   PART=s26a    the FP8 attention forward (issue 28): the 8-bit rs wgmma's GPU test, the FP8
#                attention GPU tests, its benchmark against tilepy's bf16 attention; the FP8
#                GEMM's GPU tests (mixed formats, bias + GELU) and probe
#   PART=s26b    what session 25 left unverified: the CUDA-graph tests, the GEMM op's GPU
#                tests, the shape-grid benchmark
#   PART=s24d    after the persistent TMA kernel's V loads were mended: the head-dim and persistent
#                GPU tests of the Hopper attention, the attention op's GPU tests
#   PART=s24c    V's head dim other than Q's (GPU tests, benchmark against cuDNN), the head-dim
#                GPU tests again, the key-block A/B at 96 / 192 / 256
#   PART=s24b    what s24a left: the head-dim GPU tests alone, the key-block A/B, the rest of the
#                Hopper attention GPU tests
#   PART=s23g    FP8 block scales with two alternating partial accumulators (GPU tests, the probe),
#                setmaxnreg with every two-consumer config; the grouped GEMM benchmark again
#   PART=s23f    the grouped GEMM's GPU test again (an empty group's comparison; the capture query
#                on autograd's thread)
#   PART=s23e    the grouped GEMM on the K-major TMA / wgmma kernel (GPU test, benchmark against
#                torch._grouped_mm), the FP8 GEMM after the kernel's generalisation (GPU tests,
#                CUDA graphs, benchmark)
#   PART=s23d    quantize_fp8's vector kernels (GPU tests, benchmark), the FP8 GEMM's block scales
#                and operator (GPU tests, the probe with block scales, the benchmark), the
#                float8 CUDA-graph captures, the torch operators' GPU tests
#   PART=s23c    the FP8 GEMM persistent in grouped order, 128 x 256 by default (GPU tests, the
#                probe, the benchmark); the decoding op's kernels under torch.profiler at the
#                134 MB shapes (what the time beyond a copy is); quantize_fp8 (GPU test, bench)
#   PART=s23b    the combine kernel's parallel merge (decoding GPU tests and benchmark), the FP8
#                GEMM's overlapped main loop and 128 x 256 tiles (GPU tests, probe of configs
#                against torch._scaled_mm, benchmark)
#   PART=s23a    after the host-cost fixes (recorded launches) and the whole-wave split rule: the
#                decoding GPU tests, the probe of configs x (rule, half, twice, one split), the
#                decoding benchmark; the FP8 GEMM's GPU test and benchmark (its cached plan)
#   PART=s22a    the decoding kernel (split-KV, GQA packed; issue 26): its GPU tests, the probe of
#                its configs and splits
#   PART=s22b    the decoding benchmark (bandwidth against a device copy and SDPA), the Llama
#                decoding step in a CUDA graph (tokens/s against transformers' SDPA path)
#   PART=s22d    the 8-bit float pieces (issue 28): the fp8 conversions and the e4m3 / e5m2 wgmma
#                against their twins and NumPy, quantize_fp8 at full size and its benchmark
#   PART=s22e    the FP8 GEMM against torch._scaled_mm (test and benchmark)
#   PART=s22c    grouped_gemm (issue 27): its GPU test, its benchmark against torch._grouped_mm
#                and a loop of cuBLAS calls
#   PART=s21a    issue 22's open figures (gemm_softmax as called against tilepy's own pair, the
#                host cost per call), the user soft cap with float32 constants against softcap=
#   PART=s21b    the backward benchmark (fp16, bf16) and the training step, for issue 24's table
#   PART=s21c    gemm_softmax's fused kernel against its pieces (gemm alone, softmax alone) in
#                every softmax-mode config; gemm_softmax's GPU tests (the mma.sync generator
#                split in two)
#   PART=s21d    after the kernel files' renames: the attention op's GPU tests (the float64
#                warning of user functions among them), varlen's, the GEMM op's
#   PART=s21e    issue 23's A/B at S4096: the attention kernels and gemm_softmax of the tree before
#                the Hopper tile layer (.ab/old from `git archive 17f9eea^ tilepy | tar -x -C
#                .ab/old`, carried) against this one, 6 rounds, processes alternating
#   PART=s20e    the varlen GPU tests with the PyTorch operator's autograd (eager, compiled),
#                the user functions' benchmark with a float32 ALiBi score_mod
#   PART=s20d    the benchmarks s20b / s20c ran without timings (--dist loadgroup disabled
#                pytest-benchmark): varlen, variants, user functions; the varlen backward's
#                GPU test, a user function that does not compile
#   PART=s20c    after the backward's config fix for head_dim 72 / 80 / 104 / 112: the head
#                dims' GPU test again; packed sequences (flash_attention_varlen): their GPU
#                test and benchmark, then the variants' benchmark
#   PART=s20a    s19a's GPU tests (never run: no device time), the head dims in multiples of 8
#                (forward and backward against SDPA), the torch operators' GPU tests
#   PART=s20b    s19a's benchmarks: the variants, the user functions (ALiBi built in,
#                a document mask through mod_args)
#   PART=s19a    everything of s18c (never run: no device time), then alibi_slopes= /
#                mod_args=: the launch plans' tuple arguments on the driver's parameter buffer,
#                their GPU test against SDPA on the built-in Hopper configs, the user-function
#                benchmark with ALiBi built in and a document mask through mod_args
#   PART=s18c    the soft cap on tanh.approx.f32: the PTX math GPU tests, the variants'
#                autograd GPU tests, the variants' benchmark, then user score_mod / mask_mod:
#                the attention op's GPU tests and the user functions' benchmark
#   PART=s18a    window= / softcap= on the TMA wgmma kernels: their GPU autograd tests, the
#                Hopper attention's TMA GPU tests, then the variants' benchmark
#   PART=s18b    the A/B of the plain attention kernels against the tree before (.ab/old from
#                `git archive 557dbd4 tilepy | tar -x -C .ab/old`, carried: the
#                grid TMA kernel's PTX changed by a few instructions), the attention op's GPU
#                tests
#   PART=s17c    window= / softcap= (issue 25): their GPU autograd tests, then the attention
#                op's, the torch operators' and the CUDA-graph GPU tests on the new schemas
#   PART=s17d    the variants' benchmark (a 4096-key window at S32768, a soft cap at S8192)
#   PART=s16c    after the producer-side fences (ring.arrive_copied): the backward's GPU tests
#                (longer step limit), then the training step (fp16)
#   PART=s16d    the backward benchmark, fp16 and bf16
#   PART=s16e    s16c's GPU tests and s16d's fp16 half in one call (a machine lent late)
#   PART=s16a    session 15's review mend, not yet on a GPU (consumer-side proxy fences after
#                the cp.async waits, keys past seq_k masked in the backward, dS stored before
#                dK's wgmma reads its registers): the backward's GPU tests, the probe of the
#                head_dim-128 configs (with dq_own_keys: the consumers without the dS barrier
#                between them), the backward benchmark (fp16)
#   PART=s15e    the fused (warp-specialised) backward as the head_dim-128 default: the
#                backward's GPU tests (Llama training included), the backward benchmark (fp16,
#                bf16) and the training step, then softmax's backward benchmark (never run)
#   PART=s15a    what session 14 changed after its last GPU run: the CuPy capture tests with
#                allocations on the capture stream, the backward's GPU tests (70000-long head
#                and batch axes included), the backward benchmark (the dQ blocks heaviest first)
#   PART=s14d    the attention backward: its GPU tests (gradients at full size, determinism,
#                autograd eager and compiled, a Llama trained 50 steps against SDPA), then the
#                backward benchmark (fp16)
#   PART=s14e    the rest: the backward benchmark's bfloat16 and training-step cases, the CuPy
#                stream-capture tests, the torch GPU tests
#   PART=s13a    the GEMM rebuilt from the Hopper tile pieces: its GPU tests and gemm_softmax's,
#                then the A/B against the old tree (.ab/old: `git archive COMMIT tilepy | tar -x
#                -C .ab/old`) for GEMM and gemm_softmax, rounds of 3 (bench/ab_commits.py)
#   PART=s13c    what s13a's time limits cut: the cluster and 3-D-map GEMM GPU tests, the last
#                gemm_softmax ones; the capture / torch / launch GPU tests; the Hopper guide's
#                GPU test and benchmark
#   PART=s13d    after the attention pieces moved to tilepy/tile: the Hopper attention's and the
#                attention op's GPU tests, then the attention A/B against the old tree
#   PART=s13b    the capture / torch / launch GPU tests (session 12's review mend, not yet run
#                on a GPU), the Hopper attention's GPU tests, the attention A/B
#   PART=s12f    after session 12's review mend (tensor maps per stream, graph buffers kept for
#                the process): the capture, torch and TMA GPU tests, one process per file
#   PART=s12g    the benchmarks with as-called figures: softmax (forward, backward, gemm_softmax),
#                then GEMM and attention in calls of their own (BENCH_K narrows)
#   PART=s11g    issue 10's tables from one run: the attention and GEMM benchmarks
#   PART=s11f    the GEMM benchmarks (op, kernel, fused bias + GELU)
#   PART=s11d    the TMA-store epilogue staged with stmatrix: its GPU tests, the shapes sweep
#   PART=s11c    Nsight Compute of the GEMM configs and cuBLAS at 4096^3, then the default, the
#                TMA-store epilogue and both with clusters over every shape (rounds of 3)
#   PART=s10h    the next tile's Q published early: GPU tests, persistent A/B, attention bench
#   PART=s10f    after the review mend: persistent TMA attention GPU tests, GEMM op GPU tests
#   PART=s10g    the TMA GEMM and gemm_softmax GPU tests (TmaLaunchPlan changed)
#   PART=s10d    causal: the built-in configs against persistent TMA variants
#   PART=s10b    the persistent TMA kernel with run-time tile tickets: its GPU tests, the A/B
#                in rounds
#   PART=s10     the persistent TMA attention kernel (opt-in, session 9, not yet on a GPU): its
#                GPU tests, then the A/B against the built-in configs over issue 7's shapes
#   PART=s9g     the GEMM benchmarks (descriptor_advance changed under the Hopper GEMM kernels)
#   PART=s7t     the TMA-fed attention kernel: GPU tests, then A/B against the built-in config
#   PART=s7b     the attention benchmarks (new d128 default), gemm_softmax's GPU tests
#   PART=s5      the epilogue probe (where the fused bias + GELU time goes), the attention
#                config grid over issue 7's shapes, the GEMM op benchmarks (issue 5's table)
#   PART=s5b     after the session-5 epilogue work: the TMA GEMM and op GPU tests, the epilogue
#                probe, the GEMM op benchmarks and the attention benchmarks (new defaults)
#   PART=s6      gemm_softmax (the TMA softmax mode now the sm_90 default): its GPU tests, the
#                probe of where the TMA kernel's time goes (since removed), the fused-vs-unfused benchmark
#   PART=s6g     the TMA-store GEMM epilogue: its GPU tests, then the quick sweep (4096^3,
#                8192^3) against the default
#   PART=hgemm   correctness of the TMA GEMM (odd shapes, both B layouts, persistent), then the
#                Hopper GEMM config sweep over the benchmark shapes (staged epilogue included)
#   PART=softmax the softmax / gemm_softmax benchmark suite
#   PART=hattn   correctness of the Hopper attention (the overlapped variant too), its config
#                sweep, then the fused bias + GELU GEMM and the 512^3 GEMM against their peers
#   PART=tests2  correctness: softmax at full size, the op defaults, tuning, the kernel disk
#                cache, the guide kernel
#   PART=host    host us per call and the first call, cold/warm
#   PART=tune    the softmax tuner at float16 4096 x 32768
# (default: all, for a machine without the per-call limit). tilepy on PYTHONPATH.
# Then copy OUTDIR/*.json to bench/results/<gpu>/<date>_<name>.json and run
# `python bench/plot.py && python bench/report.py`.
set -uo pipefail
OUT=${1:?usage: bench/gpu_pending.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
summary=()

step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-28s rc=%-3s %s' "$name" "$rc" "$(grep -aE '[0-9]+ (passed|failed)' \
        "$OUT/$name.log" | tail -n 1)")")
}

gpu_tests() {  # gpu_tests NAME SECONDS FILES...: GPU_TEST_WORKERS processes (default 4: a
    # process compiles its kernels one at a time, and one process ran past limits that four
    # kept; 0 runs them in this process)
    local name=$1 secs=$2
    shift 2
    step "$name" "$secs" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        -n "${GPU_TEST_WORKERS:-4}" "$@"
}

bench_suite() {  # bench_suite NAME SECONDS K: the pytest-benchmark suites selected by -k K
    local name=$1 secs=$2
    # --dist no: setup.cfg's --dist loadgroup (for the test suite) alone makes pytest-benchmark
    # see xdist as active and disable every benchmark (no timings, an empty JSON)
    step "$name" "$secs" "$PY" -m pytest -q bench -p no:cacheprovider --dist no -k "$3" \
        --benchmark-json="$OUT/$name.json" --benchmark-columns=median,rounds
}

archive_logs() {  # the steps' logs as one logs.tgz (at most 8 files come back from $OUT)
    tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
}

ncu_gemm_fp8_archive() {  # ncu_gemm_fp8_archive NAME SECONDS ARGS...: Nsight Compute of the
    # FP8 GEMM (bench/profile_gemm_fp8.py ARGS) with per-instruction stalls, its text, CSVs
    # and log as NAME.tgz (the report itself left out)
    local name=$1 secs=$2
    shift 2
    mkdir -p "$OUT/ncu"
    NCU_EXTRA="--section SourceCounters" PROFILE=gemm_fp8 step "${name}_step" "$secs" \
        bash bench/profile_attention.sh "$OUT/ncu" "$@"
    mv "$OUT/${name}_step.log" "$OUT/ncu/"
    rm -f "$OUT"/ncu/*.ncu-rep
    tar czf "$OUT/$name.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
}

PART=${PART:-s6 s5 hgemm softmax hattn tests2 host tune}
if [[ " $PART " == *" s24a "* ]]; then
    gpu_tests attention_wgmma_gpu 150 tests/test_ops_attention_wgmma.py
    gpu_tests attention_backward_wide 120 tests/test_attention_backward_gpu.py -k "D256 or D200"
    step sweep_wide 150 "$PY" bench/sweep_attention.py --wide-ab --json "$OUT/sweep_wide.json"
    bench_suite bench_attention 200 "test_flash_attention and (D96 or D192 or D256)"
fi
if [[ " $PART " == *" s25a "* ]]; then
    gpu_tests attention_head_dim_v_gpu 120 tests/test_ops_attention_wgmma.py -k "head_dim_v"
    gpu_tests attention_backward_wide 150 tests/test_attention_backward_gpu.py -k "D256 or D200"
    gpu_tests attention_op_gpu 200 tests/test_ops_attention.py
fi
if [[ " $PART " == *" s25b "* ]]; then
    gpu_tests gemm_split_k_gpu 150 tests/test_ops_gemm_wgmma_ws.py -k "split"
    step sweep_gemm_grid 330 "$PY" bench/sweep_gemm_grid.py --json "$OUT/sweep_gemm_grid.json"
fi
if [[ " $PART " == *" s25c "* ]]; then
    gpu_tests gemm_split_k_gpu 150 tests/test_ops_gemm_wgmma_ws.py -k "split"
    gpu_tests graphs_gpu 90 tests/test_cuda_graphs.py -k "gemm or flash_attention"
    bench_suite bench_gemm_grid 290 "test_gemm_shape_grid"
fi
if [[ " $PART " == *" s25d "* ]]; then
    step probe_gemm_small 200 "$PY" bench/probe_gemm_small.py --json "$OUT/probe_gemm_small.json"
    gpu_tests gemm_split_k_gpu 170 tests/test_ops_gemm_wgmma_ws.py -k "same_bits or split2 or \
split3"
    gpu_tests graphs_split_k_gpu 60 tests/test_cuda_graphs.py -k "split_k"
fi
if [[ " $PART " == *" s25e "* ]]; then
    bench_suite bench_gemm_grid 120 "test_gemm_shape_grid"
    gpu_tests graphs_gpu 110 tests/test_cuda_graphs.py -k "gemm or flash_attention"
    gpu_tests gemm_op_gpu 80 tests/test_ops_gemm_wgmma.py
    gpu_tests gemm_split_k_gpu 45 tests/test_ops_gemm_wgmma_ws.py -k "same_bits"
    step probe_gemm_small 60 "$PY" bench/probe_gemm_small.py --json "$OUT/probe_gemm_small.json"
fi
if [[ " $PART " == *" s25f "* ]]; then
    bench_suite bench_gemm_grid 110 "test_gemm_shape_grid"
    gpu_tests graphs_gpu 100 tests/test_cuda_graphs.py -k "gemm or flash_attention"
    gpu_tests gemm_op_gpu 60 tests/test_ops_gemm_wgmma.py
fi
if [[ " $PART " == *" s32a "* ]]; then
    gpu_tests attention_backward_gpu 200 tests/test_attention_backward_gpu.py
    gpu_tests block_mask_gpu 120 tests/test_ops_attention_block_mask.py
    bench_suite bench_backward_variants 200 "test_flash_attention_backward_variants"
fi
if [[ " $PART " == *" s32c "* ]]; then
    step attention_backward_gpu_x 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu -x -rf \
        --tb=short tests/test_attention_backward_gpu.py --deselect \
        tests/test_attention_backward_gpu.py::test_gpu_llama_training_loss_curve_matches_sdpa
    bench_suite bench_backward_variants 200 "test_flash_attention_backward_variants"
fi
if [[ " $PART " == *" s38a "* ]]; then
    gpu_tests block_mask_gpu 120 tests/test_ops_attention_block_mask.py
    bench_suite bench_attention_user 200 \
        "test_flash_attention_user_functions and document_block_mask"
    archive_logs
fi
if [[ " $PART " == *" s38b "* ]]; then
    bench_suite bench_attention_user 220 \
        "test_flash_attention_user_functions and (mask_mod or block_mask) and not _and"
    bench_suite bench_backward_user 120 \
        "test_flash_attention_backward_user_functions and document_block_mask"
    archive_logs
fi
if [[ " $PART " == *" s38c "* ]]; then
    gpu_tests block_mask_gpu 150 tests/test_ops_attention_block_mask.py
    bench_suite bench_backward_user 280 "test_flash_attention_backward_user_functions"
    archive_logs
fi
if [[ " $PART " == *" s39a "* ]]; then
    gpu_tests swapped_gemm_gpu 150 tests/test_ops_gemm_wgmma_ws.py -k swapped
    bench_suite bench_gemm_small_m 260 \
        "test_gemm_shape_grid and (1x4096 or 1x14336 or 1x28672 or 16x or 64x)"
    archive_logs
fi
if [[ " $PART " == *" s39b "* ]]; then
    step sweep_swapped 330 "$PY" bench/sweep_gemm_grid.py --swapped --ms 1,16,32 \
        --json "$OUT/sweep_swapped.json"
    step sweep_swapped_bcol 150 "$PY" bench/sweep_gemm_grid.py --swapped --bcol --ms 16 \
        --nk 4096x4096,4096x14336 --json "$OUT/sweep_swapped_bcol.json"
    archive_logs
fi
if [[ " $PART " == *" s39c "* ]]; then
    gpu_tests swapped_gemm_gpu 100 tests/test_ops_gemm_wgmma_ws.py -k swapped
    bench_suite bench_gemm_grid 420 "test_gemm_shape_grid"
    archive_logs
fi
if [[ " $PART " == *" s39d "* ]]; then
    step sweep_swapped_64 200 "$PY" bench/sweep_gemm_grid.py --swapped --ms 64 \
        --json "$OUT/sweep_swapped_64.json"
    archive_logs
fi
if [[ " $PART " == *" s39f "* ]]; then
    bench_suite bench_attention_short 240 \
        "test_flash_attention and (S512 or Hq32_Hkv32_S1024 or Hq16_Hkv16_S2048 or Hkv8_S4096)"
    archive_logs
fi
if [[ " $PART " == *" s40a "* ]]; then
    bench_suite bench_attention_short 240 \
        "test_flash_attention and (S512 or Hq32_Hkv32_S1024 or Hq16_Hkv16_S2048 or Hkv8_S4096)"
fi
if [[ " $PART " == *" s40a "* || " $PART " == *" s40b "* ]]; then
    step sweep_attention_short 330 "$PY" bench/sweep_attention.py --short-ab --kernels wgmma \
        --json "$OUT/sweep_attention_short.json"
    archive_logs
fi
if [[ " $PART " == *" s40c "* ]]; then
    gpu_tests head_dim_v_backward_gpu 120 tests/test_attention_backward_gpu.py -k head_dim_v
    step sweep_attention_short_d64 240 "$PY" bench/sweep_attention.py --short-ab \
        --kernels wgmma --head-dim 64 --json "$OUT/sweep_attention_short_d64.json"
    archive_logs
fi
if [[ " $PART " == *" s40d "* ]]; then
    step sweep_attention_short_d128 200 "$PY" bench/sweep_attention.py --short-ab \
        --kernels wgmma --head-dim 128 --json "$OUT/sweep_attention_short_d128.json"
fi
if [[ " $PART " == *" s40e "* ]]; then
    step s1024 110 "$PY" bench/sweep_attention.py --short-ab --kernels wgmma --head-dim 128 \
        --seq 1024 --rounds 3 --json "$OUT/sweep_short_s1024_rounds.json"
    step s512 110 "$PY" bench/sweep_attention.py --short-ab --kernels wgmma --head-dim 64 \
        --seq 512 --rounds 3 --json "$OUT/sweep_short_s512_rounds.json"
fi
if [[ " $PART " == *" s40f "* ]]; then
    gpu_tests swapped_gemm_gpu 70 tests/test_ops_gemm_wgmma_ws.py -k swapped
    bench_suite bench_gemm_rows_1_16_4096 110 \
        "test_gemm_shape_grid and (1x4096x4096 or 16x4096x4096)"
fi
if [[ " $PART " == *" s41a "* ]]; then
    gpu_tests pingpong_gemm_gpu 150 tests/test_ops_gemm_wgmma_ws.py -k pingpong
    step sweep_pingpong_4096 200 "$PY" bench/sweep_gemm_grid.py --large --ms 4096 \
        --nk 4096x4096,14336x4096,28672x8192 --json "$OUT/sweep_pingpong_4096.json"
    step sweep_pingpong_8192 150 "$PY" bench/sweep_gemm_grid.py --large --ms 8192 \
        --nk 8192x8192 --dtype float16 --json "$OUT/sweep_pingpong_8192.json"
    step sweep_pingpong_2048 60 "$PY" bench/sweep_gemm_grid.py --large --ms 2048 \
        --nk 2048x2048 --json "$OUT/sweep_pingpong_2048.json"
    archive_logs
fi
if [[ " $PART " == *" s41b "* ]]; then
    gpu_tests varlen_gpu 200 tests/test_ops_attention_varlen.py
    archive_logs
fi
if [[ " $PART " == *" s41c "* || " $PART " == *" s41e "* ]]; then
    gpu_tests backward_padded_gpu 200 tests/test_attention_backward_gpu.py -k "multiple_of_16"
fi
if [[ " $PART " == *" s41e "* ]]; then
    gpu_tests varlen_gpu 200 tests/test_ops_attention_varlen.py
fi
if [[ " $PART " == *" s41c "* || " $PART " == *" s41e "* ]]; then
    bench_suite bench_backward_padded 200 \
        "test_flash_attention_backward_padded_head_dims or test_flash_attention_varlen_backward"
    archive_logs
fi
if [[ " $PART " == *" s45a "* ]]; then
    gpu_tests backward_gpu 240 tests/test_attention_backward_gpu.py \
        -k "against_sdpa_float32 or wide_head_dims"
fi
if [[ " $PART " == *" s45d "* ]]; then
    gpu_tests wide_backward_gpu 130 tests/test_attention_backward_gpu.py -k wide_head_dims
fi
if [[ " $PART " == *" s45a "* || " $PART " == *" s45d "* ]]; then
    step probe_order_d256 170 "$PY" bench/probe_attention_backward.py --head-dim 256 \
        --causal 1 --configs 2 --order-ab --json "$OUT/probe_order_d256.json"
    step probe_d192 120 "$PY" bench/probe_attention_backward.py --head-dim 192 \
        --configs 2 --json "$OUT/probe_d192.json"
    archive_logs
fi
if [[ " $PART " == *" s45b "* ]]; then
    bench_suite bench_bwd 420 \
        "test_flash_attention_backward and (D256 or D192 or (S4096 and D128 and causal))"
    archive_logs
fi
if [[ " $PART " == *" s45c "* ]]; then
    step probe_order_d128 150 "$PY" bench/probe_attention_backward.py --head-dim 128 \
        --causal 1 --configs 1 --order-ab --json "$OUT/probe_order_d128.json"
    archive_logs
fi
if [[ " $PART " == *" s46a "* ]]; then
    gpu_tests backward_gpu 230 tests/test_attention_backward_gpu.py \
        -k "against_sdpa_float32 or wide_head_dims or head_dim_v"
    gpu_tests varlen_backward_gpu 150 tests/test_ops_attention_varlen.py \
        -k test_gpu_backward_against_sdpa
    gpu_tests fp8_out_gpu 90 tests/test_ops_gemm_fp8.py -k transposed_out
    archive_logs
fi
if [[ " $PART " == *" s46b "* ]]; then
    step probe_order_d256 170 "$PY" bench/probe_attention_backward.py --head-dim 256 \
        --causal 1 --configs 2 --order-ab --json "$OUT/probe_order_d256.json"
    step probe_d192 120 "$PY" bench/probe_attention_backward.py --head-dim 192 \
        --configs 2 --json "$OUT/probe_d192.json"
    bench_suite bench_bwd_varlen 200 "test_flash_attention_varlen_backward"
    archive_logs
fi
if [[ " $PART " == *" s46c "* ]]; then
    bench_suite bench_bwd_head_dim_v 200 "test_flash_attention_backward_head_dim_v"
    step probe_order_d128 150 "$PY" bench/probe_attention_backward.py --head-dim 128 \
        --causal 1 --configs 1 --order-ab --json "$OUT/probe_order_d128.json"
    archive_logs
fi
if [[ " $PART " == *" s44a "* ]]; then
    bench_suite bench_bwd_wide 260 "test_flash_attention_backward and (D256 or D192)"
    bench_suite bench_bwd_varlen 240 "test_flash_attention_varlen_backward"
    gpu_tests wide_backward_gpu 90 tests/test_attention_backward_gpu.py -k wide_head_dims
    archive_logs
fi
if [[ " $PART " == *" s44e "* ]]; then
    bench_suite bench_fwd_wide 280 \
        "test_flash_attention and Hkv16_S4096 and (D96 or D192 or D256) and bfloat16"
    archive_logs
fi
if [[ " $PART " == *" s44d "* ]]; then
    gpu_tests packed_fused_gpu 200 tests/test_attention_backward_gpu.py -k packed_sequences
    archive_logs
fi
if [[ " $PART " == *" s43a "* ]]; then
    gpu_tests wide_backward_gpu 200 tests/test_attention_backward_gpu.py -k wide_head_dims
    step probe_bwd_d256 300 "$PY" bench/probe_attention_backward.py --head-dim 256 \
        --json "$OUT/probe_bwd_d256.json"
    step probe_bwd_d192 150 "$PY" bench/probe_attention_backward.py --head-dim 192 \
        --json "$OUT/probe_bwd_d192.json"
    archive_logs
fi
if [[ " $PART " == *" s42a "* ]]; then
    gpu_tests fp8_gemm_gpu 120 tests/test_ops_gemm_fp8.py
    step probe_gemm_fp8 200 "$PY" bench/probe_gemm_fp8.py \
        --shapes 4096x4096x4096,8192x8192x8192 --json "$OUT/probe_gemm_fp8.json"
    step launched 120 "$PY" bench/probe_runtime_ptxas.py --launched --cubins /tmp/launched \
        --json "$OUT/launched.json"
    tar czf "$OUT/launched_cubins.tgz" -C /tmp launched
    archive_logs
fi
if [[ " $PART " == *" s42b "* ]]; then
    gpu_tests short_causal_gpu 120 tests/test_ops_attention_wgmma.py -k short_causal
    bench_suite bench_attention_short 240 \
        "test_flash_attention and (S512 or Hq32_Hkv32_S1024 or Hq16_Hkv16_S2048 or Hkv8_S4096)"
    archive_logs
fi
if [[ " $PART " == *" s42c "* ]]; then
    step ab_udiv 560 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 2 \
        --suites gemm,attention,fp8 --cases 4096 --json "$OUT/ab_udiv.json"
    archive_logs
fi
if [[ " $PART " == *" s41d "* ]]; then
    step s512_64rows 130 "$PY" bench/sweep_attention.py --short-ab --kernels wgmma \
        --head-dim 64 --seq 512 --rounds 2 --json "$OUT/sweep_short_s512_64rows.json"
    step s1024_64rows 130 "$PY" bench/sweep_attention.py --short-ab --kernels wgmma \
        --head-dim 128 --seq 1024 --rounds 2 --json "$OUT/sweep_short_s1024_64rows.json"
    archive_logs
fi
# s39g = s39h's steps, then s39e's
if [[ " $PART " == *" s39g "* || " $PART " == *" s39h "* ]]; then
    gpu_tests swapped_gemm_gpu 100 tests/test_ops_gemm_wgmma_ws.py -k swapped
    bench_suite bench_gemm_rows_1_16 120 \
        "test_gemm_shape_grid and (1x4096 or 1x14336 or 1x28672 or 16x)"
fi
if [[ " $PART " == *" s39e "* || " $PART " == *" s39g "* ]]; then
    step trace_gemm_swapped 150 "$PY" bench/trace_gemm.py --json "$OUT/trace_gemm_swapped.json" \
        --shapes 16x4096x4096,1x4096x4096,16x14336x4096,16x4096x14336,64x4096x4096
fi
if [[ " $PART " == *" s39e "* || " $PART " == *" s39g "* || " $PART " == *" s39h "* ]]; then
    archive_logs
fi
if [[ " $PART " == *" s38d "* ]]; then
    gpu_tests block_sparse_backward_gpu 100 tests/test_ops_attention_block_mask.py \
        -k block_sparse_backward_against_sdpa
    bench_suite bench_backward_user 130 \
        "test_flash_attention_backward_user_functions and document_block_mask"
    archive_logs
fi
if [[ " $PART " == *" s37a "* ]]; then
    gpu_tests block_mask_gpu 120 tests/test_ops_attention_block_mask.py
    bench_suite bench_attention_user 200 \
        "test_flash_attention_user_functions and (mask_mod or block_mask)"
    archive_logs
fi
if [[ " $PART " == *" s37b "* ]]; then
    gpu_tests gemm_pdl_gpu 90 tests/test_ops_gemm_wgmma_ws.py -k "dependent or split_k or cluster"
    bench_suite bench_gemm_grid 300 "test_gemm_shape_grid"
    archive_logs
fi
if [[ " $PART " == *" s37d "* ]]; then
    bench_suite bench_gemm_grid 200 "test_gemm_shape_grid"
fi
if [[ " $PART " == *" s37c "* ]]; then
    bench_suite bench_attention_fp8 250 "test_flash_attention_fp8"
fi
if [[ " $PART " == *" s36a "* ]]; then
    # (at most 8 files come back from $OUT: logs in an archive)
    gpu_tests kvcache_gpu 80 tests/test_ops_attention_kvcache.py
    bench_suite bench_attention_kvcache 240 "test_flash_attention_with_kvcache"
    bench_suite bench_attention_fp8 140 "test_flash_attention_fp8"
    gpu_tests attention_fp8_gpu 70 tests/test_ops_attention_fp8.py \
        tests/test_tile_online_softmax.py
    archive_logs
fi
if [[ " $PART " == *" s36e "* ]]; then   # s36d's first step alone (little device time)
    bench_suite bench_attention_fp8 250 "test_flash_attention_fp8"
fi
if [[ " $PART " == *" s36d "* ]]; then
    # s36a's FP8 benchmark ran past its 140 s (three FP8 kernels compiled per case)
    bench_suite bench_attention_fp8 290 "test_flash_attention_fp8"
    bench_suite bench_grouped_wgrad 140 "test_grouped_gemm_weight_grad"
    archive_logs
fi
if [[ " $PART " == *" s36c "* ]]; then
    step trace_decode 90 "$PY" bench/trace_decode.py --json "$OUT/trace_decode.json" \
        --shapes 8:4096:0:1,8:4096:0:4,8:4096:16:4,1:32768:0:1
    bench_suite bench_grouped_wgrad 150 "test_grouped_gemm_weight_grad"
    step overhead 90 "$PY" bench/overhead.py --calls 1000 --json "$OUT/overhead.json" \
        --profile kvcache
    archive_logs
fi
if [[ " $PART " == *" s36b "* ]]; then
    ncu_gemm_fp8_archive ncu_gemm_fp8_block 200 --configs 128x4p,128x4pt --block-scales
    archive_logs
fi
if [[ " $PART " == *" s35e "* ]]; then
    gpu_tests kvcache_grouped_gpu 90 tests/test_ops_attention_kvcache.py \
        tests/test_ops_grouped_gemm.py
    bench_suite bench_attention_kvcache 140 "test_flash_attention_with_kvcache"
fi
if [[ " $PART " == *" s35d "* ]]; then
    gpu_tests kvcache_gpu 80 tests/test_ops_attention_kvcache.py
    bench_suite bench_attention_kvcache 140 "test_flash_attention_with_kvcache"
    bench_suite bench_backward_user 250 "test_flash_attention_backward_user_functions"
fi
if [[ " $PART " == *" s35c "* ]]; then
    gpu_tests kvcache_gpu 100 tests/test_ops_attention_kvcache.py
    bench_suite bench_attention_kvcache 160 "test_flash_attention_with_kvcache"
    step trace_decode 120 "$PY" bench/trace_decode.py --json "$OUT/trace_decode.json" \
        --shapes 8:4096:0:1,8:4096:0:4,64:4096:16:1,64:4096:16:4,1:131072:0:1
fi
if [[ " $PART " == *" s35b "* ]]; then
    # (at most 8 files come back from $OUT: the Nsight files and the step logs go in archives)
    gpu_tests attention_fp8_gpu 100 tests/test_ops_attention_fp8.py
    bench_suite bench_attention_fp8 150 "test_flash_attention_fp8"
    step trace_decode 120 "$PY" bench/trace_decode.py --json "$OUT/trace_decode.json" \
        --shapes 8:4096:0:1,8:4096:0:4,64:4096:16:1,64:4096:16:4
    step overhead 90 "$PY" bench/overhead.py --calls 1000 --profile kvcache attention grouped
    LC_ALL=C tr -cd '\11\12\40-\176' < "$OUT/overhead.log" | cut -c1-160 \
        > "$OUT/overhead_profile.txt"
    ncu_gemm_fp8_archive ncu_gemm_fp8 200 --configs 256x4p,256x4pt
    archive_logs
fi
if [[ " $PART " == *" s35a "* ]]; then
    bench_suite bench_grouped 60 "test_grouped_gemm"
    step overhead 90 "$PY" bench/overhead.py --calls 1000 --profile kvcache attention grouped
    # (s34b's overhead.log did not come back: the profiles also go to a plain ASCII file)
    LC_ALL=C tr -cd '\11\12\40-\176' < "$OUT/overhead.log" | cut -c1-160 \
        > "$OUT/overhead_profile.txt"
    rm -f "$OUT/overhead.log"
    NCU_EXTRA="--section SourceCounters" PROFILE=gemm_fp8 step ncu_gemm_fp8 200 \
        bash bench/profile_attention.sh "$OUT" --configs 256x4p,256x4pt
    step ncu_attention_fp8 200 bash bench/profile_attention.sh "$OUT" --fp8 --head-dims 128
fi
if [[ " $PART " == *" s34b "* ]]; then
    step overhead 120 "$PY" bench/overhead.py --json "$OUT/overhead.json" \
        --profile kvcache attention grouped
    gpu_tests grouped_gpu 60 tests/test_ops_grouped_gemm.py
    bench_suite bench_grouped 60 "test_grouped_gemm"
    bench_suite bench_attention_kvcache 280 "test_flash_attention_with_kvcache"
    bench_suite bench_backward_variants 280 "test_flash_attention_backward_variants"
fi
if [[ " $PART " == *" s34a "* ]]; then
    gpu_tests grouped_gpu 50 tests/test_ops_grouped_gemm.py
    bench_suite bench_grouped 40 "test_grouped_gemm"
    gpu_tests graphs_split_k_gpu 40 tests/test_cuda_graphs.py -k "split_k"
    bench_suite bench_kvcache_b1 30 \
        "test_flash_attention_with_kvcache and q1 and (B1_S32768 or B1_S131072) and contiguous"
    gpu_tests kvcache_gpu 60 tests/test_ops_attention_kvcache.py
fi
if [[ " $PART " == *" s33a "* ]]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    # one process: the tests probe the idle GPU's memory, which other workers would touch
    GPU_TEST_WORKERS=0 gpu_tests multi_gpu_tests 300 tests/test_multi_gpu.py
    step multi_gpu_devices_1 120 "$PY" bench/multi_gpu.py devices --src 1 \
        --json "$OUT/multi_gpu_devices_1.json"
    step multi_gpu_devices_0 120 "$PY" bench/multi_gpu.py devices --src 0 \
        --json "$OUT/multi_gpu_devices_0.json"
    step multi_gpu_tp 200 "$PY" -m torch.distributed.run --nproc-per-node 2 \
        bench/multi_gpu.py tp --json "$OUT/multi_gpu_tp.json"
fi
if [[ " $PART " == *" s33c "* ]]; then
    gpu_tests grouped_gpu 120 tests/test_ops_grouped_gemm.py
    bench_suite bench_grouped 120 "test_grouped_gemm"
    step sweep_gemm_small 300 "$PY" bench/sweep_gemm_grid.py --ms 1,16,64 \
        --json "$OUT/sweep_gemm_small.json"
fi
if [[ " $PART " == *" s33d "* ]]; then
    gpu_tests kvcache_gpu 150 tests/test_ops_attention_kvcache.py
    bench_suite bench_attention_kvcache 300 "test_flash_attention_with_kvcache and q1"
fi
if [[ " $PART " == *" s33b "* ]]; then
    gpu_tests torch_graph_gemm_gpu 150 tests/test_torch_gpu.py tests/test_cuda_graphs.py \
        tests/test_ops_gemm.py tests/test_launch.py
    gpu_tests attention_softmax_gpu 150 tests/test_ops_attention.py \
        tests/test_ops_attention_kvcache.py tests/test_ops_softmax.py
    step overhead 120 "$PY" bench/overhead.py --json "$OUT/overhead.json"
fi
if [[ " $PART " == *" s32f "* ]]; then
    bench_suite bench_backward_user 300 "test_flash_attention_backward_user_functions"
fi
if [[ " $PART " == *" s32e "* ]]; then
    step attention_backward_gpu_x 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -n 4 -x -rf \
        --tb=short tests/test_attention_backward_gpu.py --deselect \
        tests/test_attention_backward_gpu.py::test_gpu_llama_training_loss_curve_matches_sdpa
    gpu_tests block_mask_gpu 120 tests/test_ops_attention_block_mask.py
    bench_suite bench_gemm_grid_waves 90 \
        "test_gemm_shape_grid and (1024x14336x4096 or 512x28672x8192 or 2048x14336x4096)"
    bench_suite bench_backward_variants 150 "test_flash_attention_backward_variants"
fi
if [[ " $PART " == *" s32d "* ]]; then
    gpu_tests gemm_op_gpu 80 tests/test_ops_gemm_wgmma.py
    bench_suite bench_gemm_grid 130 "test_gemm_shape_grid"
    bench_suite bench_backward_variants 150 "test_flash_attention_backward_variants"
fi
if [[ " $PART " == *" s32b "* ]]; then
    bench_suite bench_backward_block_mask 200 "test_flash_attention_backward_block_mask"
    bench_suite bench_backward_d128 150 \
        "test_flash_attention_backward and B4_H32_S4096_D128 and bfloat16 and not variants and not block_mask"
fi
if [[ " $PART " == *" s31b "* ]]; then
    step sweep_gemm_large 300 "$PY" bench/sweep_gemm_grid.py --large --ms 256,512,1024,2048,4096 \
        --json "$OUT/sweep_gemm_large.json"
    step sweep_gemm_large_2048 90 "$PY" bench/sweep_gemm_grid.py --large --ms 2048 --nk 2048x2048 \
        --json "$OUT/sweep_gemm_large_2048.json"
fi
if [[ " $PART " == *" s29a "* ]]; then
    gpu_tests gemm_ws_trace_gpu 60 tests/test_ops_gemm_wgmma_ws.py -k "gpu_traced"
    step trace_gemm 170 "$PY" bench/trace_gemm.py --json "$OUT/trace_gemm.json"
    step trace_decode 170 "$PY" bench/trace_decode.py --json "$OUT/trace_decode.json"
fi
if [[ " $PART " == *" s28b "* ]]; then
    gpu_tests block_mask_gpu 150 tests/test_ops_attention_block_mask.py
    gpu_tests attention_backward_gpu 200 tests/test_attention_backward_gpu.py
    bench_suite bench_backward_block_mask 200 "test_flash_attention_backward_block_mask"
fi
if [[ " $PART " == *" s28c "* ]]; then
    NCU_EXTRA="--section SourceCounters" PROFILE=gemm_fp8 step ncu_gemm_fp8 280 \
        bash bench/profile_attention.sh "$OUT" \
        --configs 256x4p,256x4pt
    step ncu_attention_fp8 280 bash bench/profile_attention.sh "$OUT" --fp8 --head-dims 128
fi
if [[ " $PART " == *" s28a "* ]]; then
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    step probe_gemm_fp8 200 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
fi
if [[ " $PART " == *" s27 "* || " $PART " == *" s27a "* ]]; then
    gpu_tests block_mask_gpu 150 tests/test_ops_attention_block_mask.py
    gpu_tests varlen_gpu 150 tests/test_ops_attention_varlen.py
    bench_suite bench_attention_varlen 120 "test_flash_attention_varlen"
fi
if [[ " $PART " == *" s27 "* || " $PART " == *" s27b "* ]]; then
    bench_suite bench_attention_user 240 "test_flash_attention_user_functions"
fi
if [[ " $PART " == *" s26a "* || " $PART " == *" s31a "* ]]; then   # s31a: without the probe
    gpu_tests wgmma_fp8_gpu 60 tests/test_ptx_wgmma.py -k "fp8"
    gpu_tests attention_fp8_gpu 120 tests/test_ops_attention_fp8.py
    gpu_tests graphs_fp8_gpu 90 tests/test_cuda_graphs.py -k "fp8"
    bench_suite bench_attention_fp8 150 "test_flash_attention_fp8"
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    if [[ " $PART " == *" s26a "* ]]; then
        step probe_gemm_fp8 90 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
    fi
fi
if [[ " $PART " == *" s26b "* ]]; then
    gpu_tests graphs_gpu 150 tests/test_cuda_graphs.py -k "gemm or flash_attention or fp8"
    gpu_tests gemm_op_gpu 120 tests/test_ops_gemm_wgmma.py
    bench_suite bench_gemm_grid 130 "test_gemm_shape_grid"
fi
if [[ " $PART " == *" s25s "* ]]; then
    step sweep_wide 300 "$PY" bench/sweep_attention.py --wide-ab --head-dim 256 \
        --json "$OUT/sweep_wide.json"
fi
if [[ " $PART " == *" s24d "* ]]; then
    gpu_tests attention_head_dims_gpu 150 tests/test_ops_attention_wgmma.py -k "head_dim or \
persistent"
    gpu_tests attention_op_gpu 200 tests/test_ops_attention.py
fi
if [[ " $PART " == *" s24c "* ]]; then
    gpu_tests attention_head_dim_v_gpu 120 tests/test_ops_attention_wgmma.py -k "head_dim"
    step sweep_wide 200 "$PY" bench/sweep_attention.py --wide-ab --json "$OUT/sweep_wide.json"
    bench_suite bench_attention_dv 90 "test_flash_attention_head_dim_v"
fi
if [[ " $PART " == *" s24b "* ]]; then
    gpu_tests attention_head_dims_gpu 150 tests/test_ops_attention_wgmma.py -k head_dims
    step sweep_wide 200 "$PY" bench/sweep_attention.py --wide-ab --json "$OUT/sweep_wide.json"
    gpu_tests attention_wgmma_rest 200 tests/test_ops_attention_wgmma.py -k "not head_dims and \
not against_sdpa"
fi
if [[ " $PART " == *" s23g "* ]]; then
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    step probe_gemm_fp8 200 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
    bench_suite bench_grouped_gemm 100 "test_grouped_gemm"
fi
if [[ " $PART " == *" s23f "* ]]; then
    gpu_tests grouped_gemm_gpu 120 tests/test_ops_grouped_gemm.py
fi
if [[ " $PART " == *" s23e "* ]]; then
    gpu_tests grouped_gemm_gpu 120 tests/test_ops_grouped_gemm.py
    bench_suite bench_grouped_gemm 150 "test_grouped_gemm"
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    gpu_tests fp8_graphs 90 tests/test_cuda_graphs.py -k fp8
    bench_suite bench_gemm_fp8 60 "test_gemm_fp8"
fi
if [[ " $PART " == *" s23d "* ]]; then
    gpu_tests quantize_gpu 120 tests/test_ops_quantize.py
    bench_suite bench_quantize 90 "test_quantize_fp8"
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    gpu_tests fp8_graphs 90 tests/test_cuda_graphs.py -k fp8
    gpu_tests torch_ops_fp8 90 tests/test_torch_ops.py -k "fp8 or kvcache"
    step probe_gemm_fp8 200 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
    bench_suite bench_gemm_fp8 60 "test_gemm_fp8"
fi
if [[ " $PART " == *" s23c "* ]]; then
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    step probe_gemm_fp8 150 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
    bench_suite bench_gemm_fp8 60 "test_gemm_fp8"
    step profile_decode 90 "$PY" bench/probe_decode.py --profile --shapes 1x32768,8x4096,8x32768 \
        --json "$OUT/profile_decode.json"
    gpu_tests quantize_gpu 120 tests/test_ops_quantize.py
    bench_suite bench_quantize 90 "test_quantize_fp8"
fi
if [[ " $PART " == *" s23b "* ]]; then
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    step probe_gemm_fp8 150 "$PY" bench/probe_gemm_fp8.py --json "$OUT/probe_gemm_fp8.json"
    bench_suite bench_gemm_fp8 60 "test_gemm_fp8"
    gpu_tests kvcache_gpu 120 tests/test_ops_attention_kvcache.py
    bench_suite bench_attention_kvcache 150 "test_flash_attention_with_kvcache"
fi
if [[ " $PART " == *" s23a "* ]]; then
    gpu_tests kvcache_gpu 120 tests/test_ops_attention_kvcache.py
    step probe_decode 240 "$PY" bench/probe_decode.py --json "$OUT/probe_decode.json"
    bench_suite bench_attention_kvcache 150 "test_flash_attention_with_kvcache"
    gpu_tests gemm_fp8_gpu 90 tests/test_ops_gemm_fp8.py
    bench_suite bench_gemm_fp8 60 "test_gemm_fp8"
fi
if [[ " $PART " == *" s22a "* ]]; then
    gpu_tests kvcache_gpu 120 tests/test_ops_attention_kvcache.py
    step probe_decode 300 "$PY" bench/probe_decode.py --json "$OUT/probe_decode.json"
fi
if [[ " $PART " == *" s22d "* ]]; then
    gpu_tests fp8_ptx_gpu 120 tests/test_ptx_math.py tests/test_ptx_wgmma.py -k fp8
    gpu_tests quantize_gpu 150 tests/test_ops_quantize.py
    bench_suite bench_quantize 120 "test_quantize_fp8"
fi
if [[ " $PART " == *" s22e "* ]]; then
    gpu_tests gemm_fp8_gpu 150 tests/test_ops_gemm_fp8.py tests/test_tile_hopper.py -k fp8
    bench_suite bench_gemm_fp8 150 "test_gemm_fp8"
fi
if [[ " $PART " == *" s22c "* ]]; then
    gpu_tests grouped_gemm_gpu 120 tests/test_ops_grouped_gemm.py
    bench_suite bench_grouped_gemm 200 "test_grouped_gemm"
fi
if [[ " $PART " == *" s22b "* ]]; then
    bench_suite bench_attention_kvcache 400 "test_flash_attention_with_kvcache"
    bench_suite bench_llama_decoding 150 "test_llama_decoding_step"
fi
if [[ " $PART " == *" s21a "* ]]; then
    bench_suite bench_gemm_softmax 150 "gemm_softmax_vs_unfused and builtin"
    step overhead 150 "$PY" bench/overhead.py --json "$OUT/overhead.json"
    bench_suite bench_attention_user 200 "test_flash_attention_user_functions and softcap"
fi
if [[ " $PART " == *" s21b "* ]]; then
    bench_suite bench_attention_backward 300 "test_flash_attention_backward"
    bench_suite bench_attention_training 220 "attention_training_step"
fi
if [[ " $PART " == *" s21c "* ]]; then
    step probe_gemm_softmax 240 "$PY" bench/probe_gemm_softmax.py --json "$OUT/probe_gemm_softmax.json"
    gpu_tests gemm_softmax_gpu 200 tests/test_ops_gemm_softmax.py
fi
if [[ " $PART " == *" s21d "* ]]; then
    gpu_tests attention_op 200 tests/test_ops_attention.py tests/test_ops_attention_varlen.py
    gpu_tests gemm_op 200 tests/test_ops_gemm.py tests/test_tile_gemm.py
fi
if [[ " $PART " == *" s21e "* ]]; then
    step ab_attention 450 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 6 \
        --suites attention,gemm_softmax --cases 4096 --json "$OUT/ab_attention.json"
fi
if [[ " $PART " == *" s20e "* ]]; then
    gpu_tests varlen_gpu 120 tests/test_ops_attention_varlen.py
    bench_suite bench_attention_user 170 "test_flash_attention_user_functions and alibi"
fi
if [[ " $PART " == *" s20d "* ]]; then
    gpu_tests varlen_gpu 90 tests/test_ops_attention_varlen.py
    gpu_tests user_fn_error_gpu 60 tests/test_ops_attention.py -k "does_not_compile"
    bench_suite bench_attention_varlen 100 "test_flash_attention_varlen"
    bench_suite bench_attention_variants 150 "test_flash_attention_variants"
    bench_suite bench_attention_user 150 "test_flash_attention_user_functions"
fi
if [[ " $PART " == *" s20c "* ]]; then
    gpu_tests head_dims_gpu 100 tests/test_attention_backward_gpu.py -k head_dims
    gpu_tests varlen_gpu 90 tests/test_ops_attention_varlen.py
    bench_suite bench_attention_varlen 150 "test_flash_attention_varlen"
    bench_suite bench_attention_variants 200 "test_flash_attention_variants"
fi
if [[ " $PART " == *" s20a "* ]]; then
    gpu_tests ptx_math 50 tests/test_ptx_math.py
    gpu_tests launch_tuples 50 tests/test_launch.py
    gpu_tests head_dims_gpu 90 tests/test_attention_backward_gpu.py -k "head_dims or window_and_softcap"
    gpu_tests attention_op 150 tests/test_ops_attention.py tests/test_ops_attention_wgmma.py -k "user or window or alibi"
    gpu_tests torch_gpu 120 tests/test_torch_gpu.py
fi
if [[ " $PART " == *" s20b "* ]]; then
    bench_suite bench_attention_variants 200 "test_flash_attention_variants"
    bench_suite bench_attention_user 220 "test_flash_attention_user_functions"
fi
if [[ " $PART " == *" s19a "* ]]; then
    gpu_tests ptx_math 60 tests/test_ptx_math.py
    gpu_tests launch_tuples 60 tests/test_launch.py
    gpu_tests attention_op 150 tests/test_ops_attention.py tests/test_ops_attention_wgmma.py -k "user or window or alibi"
    gpu_tests attention_variants_gpu 100 tests/test_attention_backward_gpu.py -k window_and_softcap
    bench_suite bench_attention_variants 200 "test_flash_attention_variants"
    bench_suite bench_attention_user 200 "test_flash_attention_user_functions"
fi
if [[ " $PART " == *" s18c "* ]]; then
    gpu_tests ptx_math 60 tests/test_ptx_math.py
    gpu_tests attention_variants_gpu 100 tests/test_attention_backward_gpu.py -k window_and_softcap
    bench_suite bench_attention_variants 200 "test_flash_attention_variants"
    gpu_tests attention_op 120 tests/test_ops_attention.py tests/test_ops_attention_wgmma.py -k "user or window"
    bench_suite bench_attention_user 150 "test_flash_attention_user_functions"
fi
if [[ " $PART " == *" s18a "* ]]; then
    gpu_tests attention_variants_gpu 150 tests/test_attention_backward_gpu.py -k window_and_softcap
    gpu_tests attention_wgmma_tma 150 tests/test_ops_attention_wgmma.py -k "tma"
    bench_suite bench_attention_variants 240 "test_flash_attention_variants"
fi
if [[ " $PART " == *" s18b "* ]]; then
    step ab_attention 200 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 2 \
        --suites attention --json "$OUT/ab_attention.json"
    gpu_tests attention_op 150 tests/test_ops_attention.py
fi
if [[ " $PART " == *" s17d "* ]]; then
    bench_suite bench_attention_variants 300 "test_flash_attention_variants"
fi
if [[ " $PART " == *" s17c "* ]]; then
    gpu_tests attention_variants_gpu 150 tests/test_attention_backward_gpu.py -k window_and_softcap
    gpu_tests attention_gpu 120 tests/test_ops_attention.py
    gpu_tests torch_gpu 150 tests/test_torch_gpu.py
    gpu_tests cuda_graphs 120 tests/test_cuda_graphs.py
fi
if [[ " $PART " == *" s16c "* ]]; then
    gpu_tests attention_backward_gpu 330 tests/test_attention_backward_gpu.py
    bench_suite bench_attention_training 150 "attention_training_step and float16 and not bfloat16"
fi
if [[ " $PART " == *" s16e "* ]]; then
    gpu_tests attention_backward_gpu 300 tests/test_attention_backward_gpu.py
    bench_suite bench_attention_backward 170 "test_flash_attention_backward and not bfloat16"
fi
if [[ " $PART " == *" s16d "* ]]; then
    bench_suite bench_attention_backward 300 "test_flash_attention_backward"
fi
if [[ " $PART " == *" s16a "* ]]; then
    gpu_tests attention_backward_gpu 200 tests/test_attention_backward_gpu.py
    step probe_attention_backward 150 "$PY" bench/probe_attention_backward.py --head-dim 128 \
        --json "$OUT/probe_attention_backward.json"
    bench_suite bench_attention_backward 150 "test_flash_attention_backward and not bfloat16"
fi
if [[ " $PART " == *" s15e "* ]]; then
    gpu_tests attention_backward_gpu 200 tests/test_attention_backward_gpu.py
    bench_suite bench_attention_backward 230 "test_flash_attention_backward or \
attention_training_step and float16 and not bfloat16"
    bench_suite bench_softmax_backward 75 "softmax_backward"
fi
if [[ " $PART " == *" s15a "* ]]; then
    gpu_tests cuda_graphs 150 tests/test_cuda_graphs.py
    gpu_tests attention_backward_gpu 240 tests/test_attention_backward_gpu.py
    bench_suite bench_attention_backward 180 "test_flash_attention_backward and not bfloat16"
fi
if [[ " $PART " == *" s14d "* ]]; then
    gpu_tests attention_backward_gpu 300 tests/test_attention_backward_gpu.py
    bench_suite bench_attention_backward 220 "test_flash_attention_backward and not bfloat16"
fi
if [[ " $PART " == *" s14e "* ]]; then
    bench_suite bench_attention_training 200 "attention_training_step and not bfloat16 or \
test_flash_attention_backward and bfloat16"
    gpu_tests cuda_graphs 150 tests/test_cuda_graphs.py
    gpu_tests torch_gpu 150 tests/test_torch_gpu.py
fi
if [[ " $PART " == *" s7 "* ]]; then
    # the Hopper attention: persistent and 128 x 128 overlapped configs (tests, then the
    # issue-7 grid)
    gpu_tests ops_attention_wgmma 170 tests/test_ops_attention_wgmma.py
    step sweep_attention_grid 300 "$PY" bench/sweep_attention.py --grid --kernels wgmma \
        --json "$OUT/sweep_attention_grid.json"
fi
if [[ " $PART " == *" s8 "* ]]; then
    # session 7 left these for the TMA attention default: the op's GPU tests (odd lengths,
    # layouts, LSE, caller streams, repeated calls), then clocks and power with it
    gpu_tests attention_op_tests 240 tests/test_ops_attention.py tests/test_ops_attention_wgmma.py
    step probe_clocks 60 "$PY" bench/probe_clocks.py --seconds 3 --json "$OUT/probe_clocks.json"
fi
if [[ " $PART " == *" s8s "* ]]; then
    gpu_tests schedule_tests 150 tests/test_ops_attention_wgmma.py -k "tma"
    step sweep_attention_schedules 400 "$PY" bench/sweep_attention.py --schedule-ab \
        --kernels wgmma --json "$OUT/sweep_attention_schedules.json"
fi
if [[ " $PART " == *" s8d "* ]]; then
    gpu_tests attention_op_tests 200 tests/test_ops_attention.py
    bench_suite bench_attention 200 "attention"
    step sweep_attention_d64 150 "$PY" bench/sweep_attention.py --schedule-ab --head-dim 64 \
        --kernels wgmma --json "$OUT/sweep_attention_d64.json"
fi
if [[ " $PART " == *" s8e "* ]]; then
    gpu_tests reduce_attention_tests 200 tests/test_ptx_math.py tests/test_tile_reduce.py \
        tests/test_tile_online_softmax.py tests/test_ops_attention_wgmma.py
    bench_suite bench_attention 150 "attention"
    step probe_clocks 60 "$PY" bench/probe_clocks.py --seconds 3 --json "$OUT/probe_clocks.json"
fi
if [[ " $PART " == *" s8f "* ]]; then
    gpu_tests schedule_tests 150 tests/test_ops_attention_wgmma.py -k "schedules"
    step sweep_attention_d64 200 "$PY" bench/sweep_attention.py --schedule-ab --head-dim 64 \
        --block-m 192 --kernels wgmma --json "$OUT/sweep_attention_d64.json"
fi
if [[ " $PART " == *" s8g "* ]]; then
    gpu_tests attention_op_tests 200 tests/test_ops_attention.py tests/test_tune_attention.py
    bench_suite bench_attention 150 "attention"
fi
if [[ " $PART " == *" s8h "* ]]; then
    gpu_tests schedule_tests 80 tests/test_ops_attention_wgmma.py -k "schedules or tma_against"
    bench_suite bench_attention 130 "attention"
fi
if [[ " $PART " == *" s9 "* ]]; then
    gpu_tests wgmma_tests 250 tests/test_ptx_wgmma.py tests/test_ptx_mbarrier_tma.py \
        tests/test_ops_attention_wgmma.py tests/test_ops_gemm_wgmma.py \
        tests/test_ops_gemm_wgmma_ws.py
    bench_suite bench_attention 130 "attention"
fi
if [[ " $PART " == *" s9l "* ]]; then
    gpu_tests attention_tests 200 tests/test_ops_attention_wgmma.py \
        tests/test_tile_online_softmax.py tests/test_ops_attention.py
    bench_suite bench_attention 130 "attention"
fi
if [[ " $PART " == *" s9t "* ]]; then
    gpu_tests attention_wgmma_tests 150 tests/test_ops_attention_wgmma.py
    gpu_tests online_softmax_tests 40 tests/test_tile_online_softmax.py
    gpu_tests attention_op_tests 180 tests/test_ops_attention.py
    gpu_tests gemm_ws_tests 170 tests/test_ops_gemm_wgmma_ws.py
fi
if [[ " $PART " == *" s10h "* ]]; then
    # the next tile's Q published early in the producer: GPU tests, A/B against the grid
    # kernel (compare the ratios with s10b), the attention benchmarks
    gpu_tests persistent_tma_tests 200 tests/test_ops_attention_wgmma.py -k "tma_persistent"
    step sweep_attention_persistent 300 "$PY" bench/sweep_attention.py --persistent-ab \
        --rounds 3 --json "$OUT/sweep_attention_persistent.json"
    bench_suite bench_attention 150 "attention"
fi
if [[ " $PART " == *" s11a "* ]]; then
    # clusters of two sharing B by TMA multicast (GEMM): the cluster PTX test, the TMA GEMM's
    # cluster and batch GPU tests, then the A/B against the one-block configs (medians of 3)
    gpu_tests cluster_ptx_tests 90 tests/test_ptx_cluster.py
    gpu_tests gemm_ws_cluster_tests 300 tests/test_ops_gemm_wgmma_ws.py -k "cluster or batched"
    step sweep_gemm_cluster 200 "$PY" bench/sweep_gemm_shapes.py --cluster --quick --rounds 3 \
        --json "$OUT/sweep_gemm_cluster.json"
fi
if [[ " $PART " == *" s11e "* ]]; then
    # after the default became the persistent TMA-store epilogue: the op's GPU tests, the
    # cluster PTX test, the TMA GEMM's cluster GPU tests (stmatrix staging with clusters too)
    gpu_tests cluster_ptx_tests 60 tests/test_ptx_cluster.py
    gpu_tests gemm_op_tests 280 tests/test_ops_gemm.py \
        tests/test_ops_gemm_wgmma.py::test_gpu_default_path_against_cublas \
        tests/test_ops_gemm_wgmma.py::test_gpu_batch_strides_not_16_byte_multiples
    gpu_tests gemm_ws_cluster_tests 240 tests/test_ops_gemm_wgmma_ws.py -k "cluster"
fi
if [[ " $PART " == *" s13a "* ]]; then
    gpu_tests gemm_ws 240 tests/test_ops_gemm_wgmma_ws.py
    gpu_tests gemm_softmax 120 tests/test_ops_gemm_softmax.py
    step ab_gemm 230 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 3 \
        --suites gemm,gemm_softmax --json "$OUT/ab_gemm.json"
fi
if [[ " $PART " == *" s13c "* ]]; then
    gpu_tests gemm_ws_rest 170 tests/test_ops_gemm_wgmma_ws.py -k "cluster2 or batched_3d"
    gpu_tests gemm_softmax_rest 50 tests/test_ops_gemm_softmax.py -k "stream_and_cupy or same_bits"
    gpu_tests graphs_torch 190 tests/test_cuda_graphs.py tests/test_torch_gpu.py tests/test_launch.py
    gpu_tests guide_hopper 50 tests/test_guide_hopper.py
    bench_suite bench_guide_hopper 50 "guide"
fi
if [[ " $PART " == *" s13d "* ]]; then
    gpu_tests attention_wgmma 210 tests/test_ops_attention_wgmma.py tests/test_tile_attention.py
    gpu_tests attention_op 110 tests/test_ops_attention.py
    step ab_attention 170 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 2 \
        --suites attention --json "$OUT/ab_attention.json"
fi
if [[ " $PART " == *" s13b "* ]]; then
    gpu_tests graphs_torch 200 tests/test_cuda_graphs.py tests/test_torch_gpu.py tests/test_launch.py
    gpu_tests attention_wgmma 200 tests/test_ops_attention_wgmma.py
    step ab_attention 180 "$PY" bench/ab_commits.py --a .ab/old --b . --rounds 2 \
        --suites attention --json "$OUT/ab_attention.json"
fi
if [[ " $PART " == *" s12f "* ]]; then
    gpu_tests graphs_torch 200 tests/test_cuda_graphs.py tests/test_torch_gpu.py tests/test_launch.py
    gpu_tests attention_wgmma 240 tests/test_ops_attention_wgmma.py
    gpu_tests gemm_ws 240 tests/test_ops_gemm_wgmma_ws.py
fi
if [[ " $PART " == *" s12g "* ]]; then
    bench_suite bench_softmax 500 "${BENCH_K:-softmax}"
fi
if [[ " $PART " == *" s11g "* ]]; then
    # issue 10's tables from one run of the final code: attention and GEMM benchmarks
    bench_suite bench_final 420 "attention or gemm_op or kernel_vs_cublas or bias_gelu"
fi
if [[ " $PART " == *" s11f "* ]]; then
    # the GEMM benchmarks of the final code (op, kernel, fused bias + GELU)
    bench_suite bench_gemm 300 "gemm_op or kernel_vs_cublas or bias_gelu"
fi
if [[ " $PART " == *" s11d "* ]]; then
    # the TMA-store epilogue staged with stmatrix: its GPU tests (with clusters too), then the
    # default, the TMA-store epilogue and it with clusters over every shape (rounds of 3)
    gpu_tests gemm_ws_tma_store_tests 300 tests/test_ops_gemm_wgmma_ws.py -k "tma_store"
    step sweep_gemm_shapes 280 "$PY" bench/sweep_gemm_shapes.py --rounds 3 --configs \
        "ws 128x256 s4 smem-epilogue,ws 128x256 s4 persistent tma-store,ws 128x256 s4 persistent tma-store cluster2" \
        --json "$OUT/sweep_gemm_shapes.json"
fi
if [[ " $PART " == *" s11c "* ]]; then
    # where the GEMM's time goes against cuBLAS at 4096^3 (Nsight Compute: the default, the
    # persistent TMA-store epilogue, the same with clusters), then those configs over every
    # benchmark shape in rounds (medians of 3, peer re-timed beside each)
    PROFILE=gemm_ws step profile_gemm_ws 300 bash bench/profile_attention.sh "$OUT"
    gzip -f "$OUT/ncu_gemm_ws_raw.csv" 2>/dev/null
    rm -f "$OUT/ncu_gemm_ws.ncu-rep"
    step sweep_gemm_shapes 280 "$PY" bench/sweep_gemm_shapes.py --rounds 3 --configs \
        "ws 128x256 s4 smem-epilogue,ws 128x256 s4 persistent tma-store,ws 128x256 s4 persistent tma-store cluster2,ws 128x256 s4 smem-epilogue cluster2" \
        --json "$OUT/sweep_gemm_shapes.json"
fi
if [[ " $PART " == *" s10f "* ]]; then
    # after the review mend: the persistent TMA attention GPU tests (two streams at once
    # too), then the GEMM op tests (TmaLaunchPlan now keeps arguments after the maps)
    gpu_tests persistent_tma_tests 200 tests/test_ops_attention_wgmma.py -k "tma_persistent"
    gpu_tests gemm_op_tests 280 tests/test_ops_gemm.py
fi
if [[ " $PART " == *" s10g "* ]]; then
    gpu_tests gemm_ws_tests 280 tests/test_ops_gemm_wgmma_ws.py
    gpu_tests gemm_softmax_tests 240 tests/test_ops_gemm_softmax.py
fi
if [[ " $PART " == *" s10d "* ]]; then
    # causal: the built-in configs against persistent TMA variants (ping-pong, d64 tiles)
    step sweep_attention_variants 420 "$PY" bench/sweep_attention.py --variants-ab \
        --causal-only --rounds 3 --json "$OUT/sweep_attention_variants.json"
fi
if [[ " $PART " == *" s10b "* ]]; then
    # the persistent TMA kernel with tiles handed out at run time (a global ticket counter):
    # its GPU tests, then the A/B in rounds (medians of 3, A and B in turn)
    gpu_tests persistent_tma_tests 200 tests/test_ops_attention_wgmma.py -k "tma_persistent"
    step sweep_attention_persistent 400 "$PY" bench/sweep_attention.py --persistent-ab \
        --rounds 3 --json "$OUT/sweep_attention_persistent.json"
fi
if [[ " $PART " == *" s10 "* ]]; then
    gpu_tests persistent_tma_tests 200 tests/test_ops_attention_wgmma.py -k "tma_persistent"
    step sweep_attention_persistent 300 "$PY" bench/sweep_attention.py --persistent-ab \
        --json "$OUT/sweep_attention_persistent.json"
fi
if [[ " $PART " == *" s9g "* ]]; then
    bench_suite bench_gemm 240 "gemm_op or kernel_vs_cublas"
fi
if [[ " $PART " == *" s7t "* ]]; then
    # the TMA-fed attention kernel: its GPU tests (and the 4-D TMA load), then the built-in
    # config against its TMA twin over issue 7's shapes
    gpu_tests tma_tests 150 tests/test_ops_attention_wgmma.py tests/test_ptx_mbarrier_tma.py \
        -k "tma_against or tma_4d"
    step sweep_attention_tma 200 "$PY" bench/sweep_attention.py --tma-ab --kernels wgmma \
        --json "$OUT/sweep_attention_tma.json"
fi
if [[ " $PART " == *" s7b "* ]]; then
    # after the s7 grid: the attention benchmarks with the new d128 default, gemm_softmax's
    # GPU tests with the time they need
    bench_suite bench_attention 150 "attention"
    gpu_tests gemm_softmax_tests 240 tests/test_ops_gemm_softmax.py
fi
if [[ " $PART " == *" s5 "* ]]; then
    step probe_epilogue 120 "$PY" bench/probe_epilogue.py --json "$OUT/probe_epilogue.json"
    step sweep_attention_grid 200 "$PY" bench/sweep_attention.py --grid --kernels wgmma \
        --json "$OUT/sweep_attention_grid.json"
    bench_suite bench_gemm_op 240 "gemm_op or bias_gelu"
fi
if [[ " $PART " == *" s5b "* ]]; then
    # the TMA GEMM tests alone take ~180 s on the H200
    gpu_tests gemm_ws_tests 230 tests/test_ops_gemm_wgmma_ws.py
    gpu_tests gemm_op_tests 120 tests/test_ops_gemm.py tests/test_ops_attention_wgmma.py
    step probe_epilogue 80 "$PY" bench/probe_epilogue.py --json "$OUT/probe_epilogue.json"
    bench_suite bench_gemm_op 70 "gemm_op or bias_gelu"
    bench_suite bench_attention 90 "attention"
fi
if [[ " $PART " == *" s6 "* ]]; then
    gpu_tests gemm_softmax 240 tests/test_ops_gemm_softmax.py
    bench_suite bench_gemm_softmax 200 "gemm_softmax"
fi
if [[ " $PART " == *" s6g "* ]]; then
    gpu_tests gemm_tma_store 150 tests/test_ops_gemm_wgmma_ws.py -k tma_store \
        tests/test_ops_gemm_softmax.py::test_gpu_both_parks_and_column_major_b_give_the_same_bits
    step sweep_gemm_quick 240 "$PY" bench/sweep_gemm_shapes.py --quick \
        --json "$OUT/sweep_gemm_quick.json"
fi
if [[ " $PART " == *" hgemm "* ]]; then
    gpu_tests ops_gemm_wgmma_ws 200 tests/test_ops_gemm_wgmma_ws.py
    step sweep_gemm_shapes 330 "$PY" bench/sweep_gemm_shapes.py \
        --json "$OUT/sweep_gemm_shapes.json"
fi
if [[ " $PART " == *" softmax "* ]]; then
    bench_suite bench_softmax 540 "softmax"
fi
if [[ " $PART " == *" hattn "* ]]; then
    gpu_tests ops_attention_wgmma 150 tests/test_ops_attention_wgmma.py
    step sweep_attention 200 "$PY" bench/sweep_attention.py --kernels wgmma \
        --json "$OUT/sweep_attention.json"
    bench_suite bench_gemm_epilogue 190 "bias_gelu or op_small"
fi
if [[ " $PART " == *" tests2 "* ]]; then
    gpu_tests ops_softmax 120 tests/test_ops_softmax.py
    gpu_tests ops_gemm 240 tests/test_ops_gemm.py tests/test_ops_gemm_wgmma.py \
        tests/test_tune_spaces.py tests/test_tune_attention.py tests/test_tune_softmax.py \
        tests/test_tune_kcache.py tests/test_docs.py
fi
if [[ " $PART " == *" host "* ]]; then
    step overhead 150 "$PY" bench/overhead.py --json "$OUT/overhead.json"
    step first_call 400 "$PY" bench/first_call.py --json "$OUT/first_call.json"
fi
if [[ " $PART " == *" tune "* ]]; then
    # the softmax plans at the shape the built-in plan is weakest (float16 rows of 32768)
    step tune_softmax 120 env TILEPY_CACHE_DIR="$OUT/tune_cache" "$PY" -m tilepy tune softmax \
        --shape 4096 32768 --dtype float16 --json "$OUT/tune_softmax.json"
fi

echo "== pending GPU checks =="
printf '%s\n' "${summary[@]}"
for f in "$OUT"/probe_*.log "$OUT"/sweep_*.log "$OUT"/tune_*.log; do
    [ -e "$f" ] || continue
    echo "-- ${f##*/}"
    grep -aE "TFLOPS|GB/s|best|FAILED|Error" "$f" | tail -n 24
done
if ls "$OUT"/bench_*.json >/dev/null 2>&1; then
    "$PY" bench/summary.py "$OUT"
fi
