import torch

from rlcore.batch import Trajectory, build_batch


def test_build_batch_aligns_response_tokens_and_engine_logprobs():
    trajs = [Trajectory(0, [1, 5, 6], [7, 2], [-0.5, -0.25], "stop", 3),
             Trajectory(0, [1, 5, 6], [9, 9, 9], [-1.0, -2.0, -3.0], "length", 3),
             Trajectory(1, [1, 4], [8], [-0.125], "length", 3)]
    b = build_batch(trajs, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2, 0], [1, 5, 6, 9, 9, 9], [1, 4, 8, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6, [1, 1, 1, 0, 0, 0]]
    assert b["response_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    expected = torch.tensor([[0, 0, 0, -0.5, -0.25, 0], [0, 0, 0, -1.0, -2.0, -3.0], [0, 0, -0.125, 0, 0, 0]])
    assert torch.equal(b["rollout_logprobs"], expected)

