"""Downloads the target and draft checkpoints at pinned revisions onto the models volume.

Run by the Job in deploy/kubernetes/components/model-download (mounted from a ConfigMap). Env:
TARGET_REPO, TARGET_REVISION, DRAFT_REPO, DRAFT_REVISION (from the ConfigMap specsplit-model-source),
HF_TOKEN_PATH (optional: a file holding the token for gated repos, mounted from the Secret
specsplit-hf-token; huggingface_hub reads it), MODELS_DIR (default /models).
A revision must be a commit SHA: a branch or tag can move, and two pods would then serve different
weights under one name. <MODELS_DIR>/<role>/.specsplit-revision is written last; the pods' init
container waits for it to name the expected revision.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROLES = ("target", "draft")
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
MARKER = ".specsplit-revision"
# Weights, configs and tokenizer files; not the repo's README images or other formats' weights.
PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


def sources() -> dict[str, tuple[str, str]]:
    """{role: (repo, revision)}; exits 2 naming the variable when one is missing or not a commit SHA."""
    found = {}
    for role in ROLES:
        repo_var, rev_var = f"{role.upper()}_REPO", f"{role.upper()}_REVISION"
        repo, revision = os.environ.get(repo_var, ""), os.environ.get(rev_var, "")
        if not repo:
            sys.exit(f"{repo_var}: a Hugging Face repo id is required (e.g. Qwen/Qwen3-8B)")
        if not COMMIT_SHA.fullmatch(revision):
            sys.exit(f"{rev_var}: must be a 40-hex commit SHA (a branch or tag can move), got {revision!r}")
        found[role] = (repo, revision)
    return found


def main() -> int:
    wanted = sources()
    from huggingface_hub import snapshot_download  # after validation: the check runs without it

    models = Path(os.environ.get("MODELS_DIR", "/models"))
    for role, (repo, revision) in wanted.items():
        dest = models / role
        marker = dest / MARKER
        if marker.exists() and marker.read_text().strip() == revision:
            print(f"{role}: {repo}@{revision} already present", flush=True)
            continue
        marker.unlink(missing_ok=True)
        print(f"{role}: downloading {repo}@{revision} to {dest}", flush=True)
        snapshot_download(
            repo,
            revision=revision,
            local_dir=dest,
            allow_patterns=PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
        )
        marker.write_text(revision + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
