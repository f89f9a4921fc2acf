"""`make gpu-check`: everything that needs a GPU, in one run of at most 8 minutes on one H200.

Parts, each in its own process with its own timeout (a part that times out has failed):
  tests    the CUDA test subset (kernels, triton backend, CUDA graphs) with pytest on the GPU
  kernels  Triton kernels vs their torch references: agreement, GB/s, % of peak HBM bandwidth
  engine   the engine on CUDA: CUDA graphs vs eager (same greedy tokens; decode tokens/s by batch)
  nixl     two processes: NIXL WRITEs of scattered KV pages from one's device memory into the other's
  disagg   1P1D end to end over NIXL on the GPU (router, prefill and decode processes)

One JSON comes out ($OUT/gpu_check.json where $OUT is set, else bench/results/gpu_check.json). On a
GPU machine anything that does not work fails the run (exit 1, saying which part and why); nothing
is skipped. On a machine without a GPU the run says so and exits 0. docs/gpu-check.md has the how-to;
bundle.py makes the wheels (what the GPU machine lacks) that travel with the tree.
"""
