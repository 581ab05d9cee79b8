"""Held-out target answers (greedy) for device-side evaluation: prompts + answers as JSON."""
import json, sys, torch
from common.loader import load_model, load_tokenizer
from common.distributed import Comm
from common.training import prompts as P
from common.training.measure import target_texts
from common.training.train_draft import eos_ids, prompt_ids
GG = sys.argv[1]; n = int(sys.argv[2]); new = int(sys.argv[3])
t = load_model(GG, Comm()); tok = load_tokenizer(GG)
ps = prompt_ids(tok, P.held_out_prompts()[:n], True)
ans = target_texts(t, ps, new, eos_ids(tok, t), batch_size=n)
json.dump({"prompts": ps, "answers": ans}, open(sys.argv[4], "w"))
print("ok", sum(map(len, ans)))
