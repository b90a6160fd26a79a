"""The agent-loop interface and the calculator tool task.

- A hand-built multi-turn trajectory: its loss mask reaches the objective's ``mask`` (observation tokens 0).
- The calculator task: the reward reads the answer after the tool's output; the loop answers only a call.
- On a real vLLM engine (spawned child): the model's ``:`` ends a turn, the loop's observation is appended
  with loss mask 0 and logprob 0, the next turn continues after it within the trajectory's token budget,
  and the turn limit holds.
"""


import pytest
import torch

from asyncflow.agents import Trajectory, make_agent_loop
from asyncflow.agents.calculator import CalcTask
from asyncflow.registry import RegistryError
from asyncflow.transfer_queue.batch import Batch, BatchMeta
from asyncflow.workflow.batching import to_micro_batch


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def test_hand_built_trajectory_loss_mask_reaches_the_objective(tokenizer):
    prompt = [tokenizer.bos_token_id] + _ids(tokenizer, "37,48>")
    # model ":" | tool "1776=" | model "1776"
    response = _ids(tokenizer, ":1776=1776")
    loss_mask = [1] + [0] * 5 + [1] * 4
    batch = Batch(BatchMeta("step-000000", "actor", [0], versions=[0]), {
                  "prompt_ids": [torch.tensor(prompt)], "response_ids": [torch.tensor(response)],
                  "behaviour_logprobs": [torch.zeros(len(response))], "advantages": torch.tensor([1.0]),
                  "loss_mask": [torch.tensor(loss_mask, dtype=torch.float)]})
    mb = to_micro_batch(batch, seq_len=24, pad_id=0, train_version=0, fixed_shape=True)
    # Position t scores token t+1: response token j of a 7-token prompt sits at position 6 + j.
    want = torch.zeros(23)
    want[6:16] = torch.tensor(loss_mask, dtype=torch.float)
    assert torch.equal(mb["mask"][0], want)
    assert torch.equal(mb["advantages"][0], want)  # no advantage (hence no gradient) on the tool's tokens


def test_calculator_reward_and_loop(tokenizer):
    task, loop = CalcTask(tokenizer), make_agent_loop("calculator", tokenizer)
    prompt = [tokenizer.bos_token_id] + _ids(tokenizer, "37,48>")
    assert task.operands(prompt) == (37, 48)
    assert task.reward(prompt, _ids(tokenizer, ":1776=1776")) == 1.0
    assert task.reward(prompt, _ids(tokenizer, ":1776=1700")) == 0.5
    assert task.reward(prompt, _ids(tokenizer, "1776")) == 0.0  # the answer follows the tool's output
    assert task.reward(prompt, _ids(tokenizer, "=1776")) == 0.0
    assert task.reward(prompt, _ids(tokenizer, "3:1776=17")) == 0.5
    call = Trajectory(prompt, _ids(tokenizer, ":"), [1], 1, "stop")
    assert loop.observe(call) == _ids(tokenizer, "1776=")
    assert loop.observe(Trajectory(prompt, _ids(tokenizer, "12"), [1, 1], 1, "stop")) is None
    with pytest.raises(RegistryError, match="calculator"):
        make_agent_loop("no_such_loop", tokenizer)


def _child(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from asyncflow.config import VllmConfig
    from asyncflow.engines.vllm.rollout import VllmRollout

    tok = AutoTokenizer.from_pretrained(model_dir)
    loop = make_agent_loop("calculator", tok)
    call = loop.stop_token_ids[0]
    rollout = VllmRollout(VllmConfig(max_num_seqs=8, max_model_len=64, seed=5), model_dir)
    try:
        # Make ':' likely so that turns end in tool calls (a hand-set bias on the output head).
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        weights = dict(hf.state_dict())
        weights["lm_head.weight"] = weights["lm_head.weight"].clone()
        weights["lm_head.weight"][call] += 3.0
        rollout.update_weights(weights.items(), version=1)
        stream = rollout.stream(turns=True)
        prompt = [tok.bos_token_id] + [tok.convert_tokens_to_ids(c) for c in "37,48>"]
        for i in range(8):  # short budgets: some observations do not fit and end the trajectory
            stream.add(i, prompt, 16 if i % 2 else 8, stop_token_ids=loop.stop_token_ids)
        finished, turns_seen = [], 0
        while len(stream):
            for key, sample in stream.step():
                traj = Trajectory(sample.prompt_ids, sample.response_ids, sample.loss_mask, sample.turns,
                                  sample.finish_reason)
                obs = loop.observe(traj)
                if obs and sample.turns < 3 and stream.continue_turn(key, obs):
                    turns_seen += 1
                    continue
                stream.release(key)
                finished.append((key, sample))
        return {"samples": [(s.response_ids, s.loss_mask, s.response_logprobs, s.turns, 16 if k % 2 else 8)
                            for k, s in finished],
                "call": call, "obs": loop.observe(Trajectory(prompt, [call], [1], 1, "stop")), "continued": turns_seen}
    finally:
        rollout.close()


@pytest.mark.slow
def test_multi_turn_on_vllm(tiny_model_dir, vllm_child):
    out = vllm_child.apply(_child, (str(tiny_model_dir),))
    assert len(out["samples"]) == 8 and out["continued"] > 0
    call, obs = out["call"], out["obs"]
    for response, mask, logprobs, turns, budget in out["samples"]:
        assert len(response) == len(mask) == len(logprobs) <= budget
        assert 1 <= turns <= 3
        # Every call token (kept in the response: it ends the turn) is followed by the tool's output, masked.
        for j, tok in enumerate(response):
            if tok == call and j + 1 < len(response):
                assert response[j + 1:j + 1 + len(obs)] == obs[:len(response) - j - 1]
                assert mask[j] == 1 and set(mask[j + 1:j + 1 + len(obs)]) == {0}
                assert all(lp == 0.0 for lp in logprobs[j + 1:j + 1 + len(obs)])
        assert sum(1 for m in mask if m == 0) == len(obs) * (turns - 1)
        assert all(lp <= 0 for lp, m in zip(logprobs, mask) if m)
    # (The biased head makes ':' nearly certain, logprob about 0: vLLM's logprobs themselves are checked
    # against Hugging Face and Megatron in tests/engines/vllm.)
