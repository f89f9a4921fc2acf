"""The serving profile's sample classification (py-spy raw stacks, made up here)."""

from tandem.bench.profile_serve import summarize

LOOP = "_run (services/worker/loop.py:90)"
FWD = "forward (engine/models/llama.py:80)"
RAW = "\n".join([
    f"thread (0x1);{LOOP};step (engine/engine.py:130);run (engine/runner/model_runner.py:160);{FWD};"
    "forward (engine/attention/torch_backend.py:120);_decode (engine/attention/torch_backend.py:140) 30",
    f"thread (0x1);{LOOP};step (engine/engine.py:130);run (engine/runner/model_runner.py:160);{FWD};"
    "forward (torch/nn/modules/linear.py:125) 30",
    f"thread (0x1);{LOOP};step (engine/engine.py:130);run (engine/runner/model_runner.py:160);{FWD};"
    "forward (engine/models/prepack.py:40) 20",
    f"thread (0x1);{LOOP};step (engine/engine.py:130);schedule (engine/scheduler/scheduler.py:99) 10",
    f"thread (0x1);{LOOP};step (engine/engine.py:130);_emit (engine/engine.py:150) 10",
    f"thread (0x1);{LOOP};wait (threading.py:331) 100",
    "thread (0x2);serve (grpc/aio/_server.py:10);forward (torch/nn/modules/linear.py:125) 999",
])


def test_engine_thread_samples_are_charged_to_the_innermost_known_part():
    s = summarize(RAW)
    assert s["engine_samples_busy"] == 100 and s["engine_samples_idle"] == 100
    assert s["shares_of_busy"] == {"linear": 0.5, "attention": 0.3, "scheduling": 0.1, "detokenize_emit": 0.1}
    assert s["busy_share_of_engine_thread"] == 0.5
