"""The APIs agents speak, against Tandem's HTTP gateway: OpenAI's Responses API (a conversation kept
by the gateway, streamed) and Anthropic's Messages API, each through its official client.

    .venv/bin/python examples/agent_apis.py [--url http://127.0.0.1:8000] [--api-key KEY]
"""

import argparse

import anthropic
import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused", help="the gateway's --api-key, if it has one")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id

    # A conversation: the follow-up names the first response; the gateway prompts the model with both
    # turns, and the first turn's KV comes from the prefix cache (cached_tokens).
    first = client.responses.create(model=model, instructions="Answer in one sentence.",
                                    input="What is the capital of France?", max_output_tokens=32, temperature=0)
    print(first.output_text)
    second = client.responses.create(model=model, instructions="Answer in one sentence.", input="And of Italy?",
                                     previous_response_id=first.id, max_output_tokens=32, temperature=0)
    print(second.output_text, f"[{second.usage.input_tokens_details.cached_tokens} prompt tokens cached]")

    with client.responses.stream(model=model, input="Write a haiku about the sea.", max_output_tokens=48) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
    print()

    claude = anthropic.Anthropic(base_url=args.url, api_key=args.api_key)
    message = claude.messages.create(model=model, max_tokens=32, system="Be brief.",
                                     messages=[{"role": "user", "content": "Name three colours."}])
    print(message.content[0].text, f"[stop: {message.stop_reason}]")
    with claude.messages.stream(model=model, max_tokens=32,
                                messages=[{"role": "user", "content": "Count to five."}]) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
