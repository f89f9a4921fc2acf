"""The synchronous SDK: a whole generation, then a streamed one (start the stack with `make run`).

    .venv/bin/python examples/sdk_generate.py [--target 127.0.0.1:50051]
"""

import argparse

from tandem_client import Client, SamplingParams, TandemError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the router's gRPC address")
    args = parser.parse_args()

    with Client(args.target, timeout=120) as client:
        result = client.generate("The capital of France is", max_tokens=16, temperature=0)
        print(f"{result.text!r} ({result.finish_reason}, {result.usage.prompt_tokens} prompt + "
              f"{result.usage.completion_tokens} completion tokens)")

        params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=1, stop=["\n\n"])
        for chunk in client.stream("Once upon a time", params):
            print(chunk.text, end="", flush=True)
        print()

        try:
            client.generate("Hello", max_tokens=0)
        except TandemError as e:  # the server's message, and which parameter was wrong
            print(f"{type(e).__name__}: {e} (param: {e.param})")


if __name__ == "__main__":
    main()
