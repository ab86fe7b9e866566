import torch

from visppo.encoders import NatureCNN, ObsEncoder


def test_uint8_frames_are_scaled_inside_forward():
    enc = NatureCNN(3, 64, 16)
    x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    torch.testing.assert_close(enc(x), enc(x.float() / 255.0))


def test_channels_last_model_gives_the_same_features():
    torch.manual_seed(0)
    enc = NatureCNN(9, 84, 32)
    x = torch.randint(0, 256, (4, 9, 84, 84), dtype=torch.uint8)
    ref = enc(x)
    enc = enc.to(memory_format=torch.channels_last)
    torch.testing.assert_close(enc(x), ref, rtol=1e-4, atol=1e-5)


def test_state_branch_concatenates():
    enc = ObsEncoder((6, 64, 64), 5, 32, 8)
    out = enc({"pixels": torch.zeros(3, 6, 64, 64, dtype=torch.uint8), "state": torch.zeros(3, 5)})
    assert out.shape == (3, 40) and enc.out_dim == 40


def test_samples_are_independent_of_their_batch():
    """No layer mixes samples: a sample's features do not depend on the others."""
    enc = ObsEncoder((3, 64, 64), 2, 16, 8)
    obs = {"pixels": torch.randint(0, 256, (5, 3, 64, 64), dtype=torch.uint8), "state": torch.randn(5, 2)}
    full = enc(obs)
    part = enc({k: v[2:4] for k, v in obs.items()})
    torch.testing.assert_close(part, full[2:4], rtol=1e-5, atol=1e-6)
