"""The asyncio SDK: several generations at once, and a stream cancelled half-way.

    .venv/bin/python examples/sdk_async.py [--target 127.0.0.1:50051]
"""

import argparse
import asyncio

from tandem_client import AsyncClient


async def main(target: str) -> None:
    async with AsyncClient(target, timeout=120) as client:
        prompts = ["The capital of France is", "The largest planet is", "Water boils at"]
        results = await asyncio.gather(*(client.generate(p, max_tokens=12, temperature=0) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            print(f"{prompt}{result.text!r}")

        # Leaving the `async with` block (here after ~20 tokens) cancels the generation on the server.
        received = 0
        async with client.stream("Tell me a long story.", max_tokens=512, ignore_eos=True) as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
                received += len(chunk.token_ids)
                if received >= 20:
                    break
        print(f"\n[cancelled after {received} tokens]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the router's gRPC address")
    asyncio.run(main(parser.parse_args().target))
