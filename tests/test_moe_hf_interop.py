"""Hugging Face Mixtral and Qwen2-MoE models imported into megapp, in one process and with
the experts split over expert-parallel (and expert-tensor-parallel) ranks: the logits
equal transformers' in fp32, the export is bitwise the original folder, and greedy
generation gives transformers' tokens. The tiny models' weights are drawn with std 0.3
so that the routing and the next tokens vary.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.checkpointing.state import Placement
from megapp.models.generation import generate
from megapp.models.gpt import build_gpt_chunks
from megapp.models.hf_checkpoint import hf_gpt_config, load_hf, save_hf
from megapp.testing import distributed
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.transformer.config import ExpertGroups
from tests.support import HF_RUN as RUN
from tests.support import assert_same_model, convert_tool, hf_tensors, tool_main

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, NEW = 96, 2, 12, 12
TOL = dict(atol=1e-5, rtol=1e-5)


def _configs() -> dict:
    t = transformers
    small = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        num_experts_per_tok=2,
        bos_token_id=None,
        eos_token_id=None,  # greedy decoding runs its whole length
    )
    return {
        "mixtral": t.MixtralConfig(
            **small, intermediate_size=48, num_hidden_layers=2, num_local_experts=4
        ),
        # layers 0 and 2 sparse, layer 1 dense; a gated shared expert; k probabilities as is
        "qwen2_moe": t.Qwen2MoeConfig(
            **small,
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_hidden_layers=3,
            num_experts=4,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        "qwen2_moe_norm": t.Qwen2MoeConfig(
            **small,
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_hidden_layers=2,
            num_experts=4,
            norm_topk_prob=True,
        ),
    }


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Each model's folder with its logits and greedy continuation of a fixed prompt."""
    root = tmp_path_factory.mktemp("hf_moe")
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    for name, config in _configs().items():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():  # norms and biases away from their init too
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / name)
        with torch.no_grad():
            logits = model(tokens).logits
            greedy = model.generate(
                tokens[:, :4],
                max_new_tokens=NEW,
                do_sample=False,
                attention_mask=torch.ones_like(tokens[:, :4]),
                pad_token_id=0,
            )
        torch.save({"tokens": tokens, "logits": logits, "greedy": greedy}, root / name / "ref.pt")
    return root


def _import(source, **layout):
    config, model_type = hf_gpt_config(
        str(source), hidden_dropout=0.0, attention_dropout=0.0, **layout
    )
    return config, model_type


@pytest.mark.parametrize("name", list(_configs()))
def test_one_process_import_matches_transformers_and_exports_bitwise(hf_models, tmp_path, name):
    source = hf_models / name
    config, model_type = _import(source)
    (chunk,) = build_gpt_chunks(config)
    load_hf([chunk], str(source), model_type)
    reference = torch.load(source / "ref.pt")
    chunk.eval()
    with torch.no_grad():
        logits = chunk(reference["tokens"])[..., :VOCAB]
    torch.testing.assert_close(logits, reference["logits"], **TOL)
    greedy = generate(chunk, reference["greedy"][:, :4], NEW)
    assert len(set(greedy[0, 4:].tolist())) > 3  # the continuation varies
    assert torch.equal(greedy, reference["greedy"])

    save_hf([chunk], str(tmp_path / "export"), model_type, source_dir=str(source))
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "export")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.equal(again(reference["tokens"]).logits, reference["logits"])


LAYOUTS = [
    # (world, tp, ep, etp, models)
    (2, 1, 2, None, ["mixtral", "qwen2_moe"]),
    (4, 2, 2, None, ["qwen2_moe_norm"]),
    (4, 2, 2, 1, ["mixtral"]),
]
CASES = [(w, tp, ep, etp, m) for w, tp, ep, etp, models in LAYOUTS for m in models]


@pytest.mark.parametrize(
    "world_size, tp, ep, etp, name",
    [c if c[0] == 2 else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
@distributed(timeout=240)
def test_expert_layouts_import_match_transformers_and_export_bitwise(
    world_size, tp, ep, etp, name, hf_models, tmp_path
):
    source = hf_models / name
    ps.initialize_model_parallel(
        tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    tp_group = ps.get_tensor_model_parallel_group()
    config, model_type = _import(
        source,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        make_vocab_size_divisible_by=7,
    )
    ep_group, etp_group = (
        ps.get_expert_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
    )
    (chunk,) = build_gpt_chunks(
        config, tp_group=tp_group, expert_groups=ExpertGroups(ep_group, etp_group, tp_group)
    )
    placement = Placement(
        ps.get_tensor_model_parallel_rank(),
        tp,
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ep,
    )
    load_hf([chunk], str(source), model_type, placement=placement)
    reference = torch.load(source / "ref.pt")
    chunk.eval()
    with torch.no_grad():
        shard = chunk(reference["tokens"])  # [b, s, V_pad/tp]
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    logits = torch.cat(parts, dim=-1)[..., :VOCAB]
    torch.testing.assert_close(logits, reference["logits"], **TOL)

    export = tmp_path / "export"
    save_hf([chunk], str(export), model_type, placement=placement, source_dir=str(source))
    if dist.get_rank() == 0:
        original, exported = hf_tensors(source), hf_tensors(export)
        assert sorted(exported) == sorted(original)
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), key


def test_pretrain_under_ep2_to_checkpoint_to_hf_is_bitwise(corpus, tmp_path, capsys):
    """HF Qwen2-MoE -> ``pretrain_gpt.py --load-hf`` with the experts over two ranks (one
    step at learning rate 0) -> ``--save-hf`` and a checkpoint -> ``convert_hf.py export``:
    both folders hold the original tensors bit for bit; the checkpoint and the original
    folder generate the same tokens."""
    torch.manual_seed(3)
    config = _configs()["qwen2_moe"]
    config.vocab_size = 300  # the byte tokenizer's 257 ids fit
    source = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(source)
    status, flags, err = tool_main(capsys, "convert_hf", "flags", source)
    assert status == 0, err
    model_flags = flags.split()
    assert "--moe-shared-expert-gate" in model_flags and "--moe-layer-freq" in model_flags
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    job = run_pretrain_in_world(
        2,
        [
            *model_flags,
            *RUN,
            *data,
            *("--expert-model-parallel-size", "2"),
            *("--load-hf", source, "--save", tmp_path / "ckpt"),
            *("--save-hf", tmp_path / "from_ep2"),
        ],
        cwd=tmp_path,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert_same_model(tmp_path / "from_ep2", source)
    out = tmp_path / "tool"
    status, err = convert_tool(capsys, "export", tmp_path / "ckpt", "--output", out)
    assert status == 0, err
    assert_same_model(out, source)
    args = ["--prompt", "def main(", "--max-new-tokens", "8", "--ids"]
    from_hf = tool_main(
        capsys, "generate", "--hf", source, "--tokenizer-type", "ByteTokenizer", *args
    )
    from_checkpoint = tool_main(capsys, "generate", "--load", tmp_path / "ckpt", *args)
    assert from_hf[0] == 0 and from_checkpoint[0] == 0, (from_hf[2], from_checkpoint[2])
    assert from_checkpoint[1] == from_hf[1]
