"""The target's greedy answers to the first N held-out prompts, as JSON, for evaluating a draft where
the target cannot go (train-draft --eval-answers, bench_draft.py --answers).

    python heldout_answers.py TARGET N MAX_NEW_TOKENS OUT.json
"""

import json
import sys

from common.distributed import Comm
from common.loader import load_model, load_tokenizer
from common.training import prompts
from common.training.measure import target_texts
from common.training.train_draft import eos_ids, prompt_ids


def main() -> None:
    target_path, n, max_new, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    target, tokenizer = load_model(target_path, Comm()), load_tokenizer(target_path)
    ids = prompt_ids(tokenizer, prompts.held_out_prompts()[:n], chat=True)
    answers = target_texts(target, ids, max_new, eos_ids(tokenizer, target), batch_size=n)
    with open(out, "w") as f:
        json.dump({"prompts": ids, "answers": answers}, f)
    print("answer tokens:", sum(map(len, answers)))


if __name__ == "__main__":
    main()
