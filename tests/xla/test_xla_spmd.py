"""The SPMD seam: the stories260K model with its linear weights sharded over 4 virtual PJRT
CPU devices gives the reference greedy tokens (XLA's partitioner adds the collectives). Run in
a subprocess: SPMD must be switched on before the process makes any XLA tensor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is only in .venv-xla (scripts/setup_xla.sh)")

from tessellm_xla.spmd import partition_spec  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, sys
    from tessellm_xla.spmd import annotate_tensor_parallel, tensor_parallel_mesh
    mesh = tensor_parallel_mesh()
    import torch_xla
    from tessellm import LLM, SamplingParams
    stories = sys.argv[1]
    ref = json.load(open(stories + "/reference_greedy.json"))
    llm = LLM(stories, device="xla", dtype="float32", load_progress=False, max_num_seqs=2,
              max_num_batched_tokens=16)
    applied = annotate_tensor_parallel(llm.engine.parts.weights, mesh)
    w = llm.engine.parts.weights["qkv_proj.0.weight"]
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    print(json.dumps({"devices": int(mesh.size()), "annotated": sorted(applied),
                      "qkv_sharding": torch_xla._XLAC._get_xla_sharding_spec(w),
                      "tokens": llm.encode(ref["prompt"]) + out.token_ids,
                      "reference": ref["token_ids"]}))
""")


def test_partition_rules() -> None:
    assert partition_spec("qkv_proj.0.weight", (128, 64)) == ("tp", None)
    assert partition_spec("model.layers.0.mlp.down_proj.weight", (64, 172)) == (None, "tp")
    assert partition_spec("model.norm.weight", (64,)) is None
    assert partition_spec("model.embed_tokens.weight", (512, 64)) is None


@pytest.mark.slow
def test_sharded_weights_give_the_reference_tokens(stories_dir) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 4
    assert len(got["annotated"]) == 20     # 5 layers x (qkv, o, gate_up, down)
    assert got["qkv_sharding"].startswith("{devices=[4,1]")
    assert got["tokens"] == got["reference"]
