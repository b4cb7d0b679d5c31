"""Four short chats answered greedily with their context kept whole and compressed by the default press at 25% kept
(the forty-fifth session's probe behind ``kvcompress serve --compress-min-tokens``; docs/BENCHMARKS.md, "Short
contexts are stored whole"). From the repository root: ``PYTHONPATH=. python
results/serve_load/short_contexts/probe.py``; its printout: ``probe.txt`` beside it."""

import torch
from transformers import DynamicCache

from kvcompress.models import load_model
from kvcompress.registry import make_press
from kvcompress.serve.protocol import Message, chat_split
from kvcompress.serve.store import answer_view

CHATS = [
    [("system", "You are a pirate. Always talk like a pirate and say 'Arrr' in every answer."),
     ("user", "What is the capital of France?")],
    [("user", "My name is Alice and I live in Paris."), ("assistant", "Nice to meet you, Alice!"),
     ("user", "What is my name?")],
    [("system", "Answer with one word only."), ("user", "What color is the sky on a clear day?")],
    [("user", "Remember the number 7342."), ("assistant", "Got it, 7342."),
     ("user", "Which number did I ask you to remember?")],
]


def answer(model, tokenizer, press, context: list[int], question: list[int], tokens: int = 24) -> str:
    """The greedy answer with the context prefilled under ``press`` (None: kept whole), as the server answers."""
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    view, position = answer_view(cache), len(context) + len(question)
    out = model(input_ids=torch.tensor([question]), past_key_values=view,
                position_ids=torch.arange(len(context), position)[None])
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < tokens and generated[-1] != tokenizer.eos_token_id:
        out = model(input_ids=torch.tensor([generated[-1:]]), past_key_values=view,
                    position_ids=torch.tensor([[position]]))
        position += 1
        generated.append(int(out.logits[0, -1].argmax()))
    return tokenizer.decode(generated, skip_special_tokens=True)


def main() -> None:
    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    press = make_press("compresskv", 0.75, 0)
    with torch.no_grad():
        for chat in CHATS:
            context, question = chat_split(tokenizer, [Message(role=r, content=t) for r, t in chat])
            print(f"{len(context)} context tokens")
            print("  kept whole:", repr(answer(model, tokenizer, None, context, question)))
            print("  compressed:", repr(answer(model, tokenizer, press, context, question)))


if __name__ == "__main__":
    main()
