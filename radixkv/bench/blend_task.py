"""A synthetic RAG task whose answer needs facts from two documents, and a small Llama trained on
it here, on the CPU, in a few minutes: the trained model of ``python -m radixkv.bench blend``.

Vocabulary: ``PAD BOS DOC Q ANS``, then keys and values.  A document is ``DOC`` and ``FACTS``
facts ``key value``.  A prompt is a system prompt (``BOS`` and fixed tokens), ``k`` documents in
random order and the question ``Q key1``, then ``key2`` once the model answered ``value1``: the two
keys are facts of two different documents, and the answer is the two values (greedy, one token
each), so neither document alone gives it.  (A first version asked ``Q key1 key2 ANS`` for both
values at once; the model did not learn it in a few CPU minutes: 14% per answer token after 1,500
steps.  Asking each key right before its value is the classic induction pattern, learned fast.)  Training prompts draw fresh random documents every batch (the model learns to
look facts up, not a table); evaluation uses a fixed corpus of documents whose KV a segment cache
holds, ``k`` of them per prompt, in random order.

``python -m radixkv.bench.blend_task`` trains the model and prints its accuracy with full prefill.
Training is deterministic for a seed, a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

PAD, BOS, DOC, Q, ANS = 0, 1, 2, 3, 4
SYSTEM = [BOS, 5, 6, 7]                    # the system prompt
FACTS = 4                                   # facts per document
QUESTIONS = 6                               # questions per training prompt (evaluation asks one)
NUM_KEYS, NUM_VALUES = 128, 32
KEY0 = 8
VALUE0 = KEY0 + NUM_KEYS
VOCAB = VALUE0 + NUM_VALUES


def documents(rng: random.Random, count: int) -> list[tuple[list[int], dict[int, int]]]:
    """``count`` documents with distinct keys: each its tokens and its facts."""
    keys = rng.sample(range(KEY0, VALUE0), count * FACTS)
    docs = []
    for i in range(count):
        facts = {k: rng.randrange(VALUE0, VOCAB) for k in keys[i * FACTS:(i + 1) * FACTS]}
        docs.append(([DOC, *[t for kv in facts.items() for t in kv]], facts))
    return docs


def prompt_of(rng: random.Random, docs: list[tuple[list[int], dict[int, int]]]
              ) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """A prompt over ``docs`` (in this order) asking a fact of each of two of them: tokens (ending
    ``Q key1 key2``: the first question is the prompt without its last token, the second the
    prompt with ``value1`` put before ``key2``), document spans, the two answer tokens."""
    first, second = rng.sample(range(len(docs)), 2)
    key1, key2 = rng.choice(list(docs[first][1])), rng.choice(list(docs[second][1]))
    tokens, spans = list(SYSTEM), []
    for doc, _ in docs:
        spans.append((len(tokens), len(tokens) + len(doc)))
        tokens += doc
    answer = [docs[first][1][key1], docs[second][1][key2]]
    return tokens + [Q, key1, key2], spans, answer


class Corpus:
    """``count`` fixed documents: the knowledge base whose KV a segment cache holds."""

    def __init__(self, count: int, seed: int) -> None:
        self.docs = documents(random.Random(seed), count)

    def question(self, rng: random.Random, k: int) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """A prompt of ``k`` corpus documents in random order: tokens, spans, the two answer tokens."""
        return prompt_of(rng, rng.sample(self.docs, k))


def model_config(layers: int = 3, hidden: int = 64) -> Any:
    """The Llama config of the task's model (GQA: 4 heads, 2 KV heads)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    config.name_or_path = f"radixkv/blend-task-l{layers}-h{hidden}"
    return config


def train(steps: int = 1500, batch: int = 32, seed: int = 0, log: Any = print) -> Any:
    """Train the task's model from ``seed``; return it in eval mode.  Cost: ``steps`` forward and
    backward passes of ``batch`` prompts of 2-6 documents (minutes on a CPU)."""
    import transformers

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step in range(steps):
        examples = []
        for _ in range(batch):                     # several questions per prompt: more signal per step
            docs = documents(rng, rng.randint(2, 6))
            tokens, _, answer = prompt_of(rng, docs)
            tokens, targets = tokens[:-3] + [Q], []
            for _ in range(QUESTIONS):
                more, _, answer = prompt_of(rng, docs)
                for key, value in zip(more[-2:], answer):
                    tokens.append(key)
                    targets.append(len(tokens))
                    tokens.append(value)
            examples.append((tokens, targets))
        width = max(len(t) for t, _ in examples)
        ids = torch.full((batch, width), PAD)
        mask = torch.zeros(batch, width, dtype=torch.long)
        rows, cols = [], []
        for i, (t, where) in enumerate(examples):   # left padding
            ids[i, width - len(t):] = torch.tensor(t)
            mask[i, width - len(t):] = 1
            rows += [i] * len(where)
            cols += [width - len(t) + w for w in where]
        logits = model(input_ids=ids, attention_mask=mask).logits[rows, [c - 1 for c in cols]]   # predicts ids[rows, cols]
        target = ids[rows, cols]
        loss = torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            acc = float((logits.argmax(-1) == target).float().mean())
            log(f"# step {step:5d}  loss {loss.item():.3f}  answer-token accuracy {acc:.2f}  {time.perf_counter() - t0:.0f} s")
    return model.train(False)


def main(argv: list[str] | None = None) -> int:
    """Train the model and print its full-prefill accuracy on a corpus; 0."""
    parser = argparse.ArgumentParser(prog="python -m radixkv.bench.blend_task", description=__doc__)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = train(args.steps, seed=args.seed)
    corpus, rng = Corpus(16, 1), random.Random(2)
    right = 0
    for _ in range(200):
        tokens, _, answer = corpus.question(rng, rng.randint(2, 6))
        with torch.no_grad():
            first = int(model(input_ids=torch.tensor(tokens[:-1])[None]).logits[0, -1].argmax())
            second = int(model(input_ids=torch.tensor(tokens[:-1] + [first, tokens[-1]])[None]).logits[0, -1].argmax())
        right += [first, second] == answer
    print(f"full-prefill accuracy on the corpus: {right / 200:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
