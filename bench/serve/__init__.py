"""`tandem bench serve|sweep`: a load-test harness for any OpenAI HTTP endpoint or Tandem's gRPC API.

    datasets.py   what to send: random (exact token counts), shared-prefix, ShareGPT files
    multiturn.py  conversations sent turn by turn, each after the previous answer (closed loop)
    backends.py   how to send it and time it: "openai-http" (SSE), "tandem-grpc" (stream)
    runner.py     when to send it: Poisson / gamma arrivals, a concurrency cap, warm-ups
    load_profile.py  --load-profile: phases of rate and lengths in one run, per-phase metrics, time series
    metrics.py    what it measured: TTFT, TPOT, ITL, E2E, throughput, goodput (pure Python)
    serve.py      one benchmark at one or more request rates -> JSON + PNG
    sweep.py      the same workload against deployments this tool starts itself -> one table
    plots.py      latency CDFs, throughput / goodput vs request rate (matplotlib)
"""
