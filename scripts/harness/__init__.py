"""What every benchmark in scripts/ shares (scripts run as `python scripts/x.py`, so `scripts/` is on
sys.path and this package imports as `harness`):

  timing       CUDA-graph timing over rotated copies (GPU) and host wall-clock timing (CPU)
  workload     ShareGPT requests (vLLM's sampling), the requests file, LoRA weights and
               token -> adapter-slot mappings of the kernel benchmarks
  cli          compile here / run on the GPU machine: sub-commands, logs, result JSON with the
               machine and the command line
  compiler     the compiler pieces the `compile` sub-commands build from (one import site)
  torch_llama  the plain-PyTorch Llama the model benchmarks compare against
  offline      requests through AsyncMLCEngine, all at once, timed by the host clock
  plot         the one plotting path (matplotlib; SVG or PNG by the file's suffix)
"""
