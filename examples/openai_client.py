"""The official `openai` package against Tandem's HTTP gateway: chat, streaming, completions.

    .venv/bin/python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]
"""

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the gateway's --api-key, if it has one")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    print(chat.choices[0].message.content, f"[{chat.usage.prompt_tokens}+{chat.usage.completion_tokens} tokens]")

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=48, temperature=0.7, seed=1, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens]")

    # Tandem's extra sampling parameters travel in extra_body.
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.8,
                                     stop=["\n"], extra_body={"top_k": 40, "min_p": 0.05})
    print(repr(text.choices[0].text))


if __name__ == "__main__":
    main()
