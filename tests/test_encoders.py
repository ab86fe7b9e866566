import pytest
import torch
from torch.utils.checkpoint import checkpoint

from visppo import encoders
from visppo.encoders import DrQCNN, ImpalaCNN, NatureCNN, ObsEncoder
from visppo.errors import ConfigError


def test_uint8_frames_are_scaled_inside_forward():
    enc = NatureCNN(3, 64, 16)
    x = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    torch.testing.assert_close(enc(x), enc(x.float() / 255.0))


def test_under_autocast_frames_go_straight_to_its_dtype_with_the_same_values():
    every = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = encoders._uint8_to_conv_input(every)
    assert direct.dtype == torch.bfloat16  # no fp32 copy of the batch
    assert torch.equal(direct, (every.float() / 255.0).to(torch.bfloat16))  # what autocast would cast
    assert encoders._uint8_to_conv_input(every).dtype == torch.float32  # no autocast: fp32


@pytest.mark.parametrize("make", [lambda: NatureCNN(9, 64, 16), lambda: ImpalaCNN(9, 64, 16),
                                  lambda: DrQCNN(9, 64, 16)], ids=["nature", "impala", "drq"])
def test_bf16_encoders_give_the_same_features_and_gradients_as_with_an_fp32_copy(make, monkeypatch):
    torch.manual_seed(0)
    enc = make().to(memory_format=torch.channels_last)
    x = torch.randint(0, 256, (4, 9, 64, 64), dtype=torch.uint8)

    def run():
        enc.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = enc(x)
        out.float().square().sum().backward()
        return out.detach(), [p.grad.clone() for p in enc.parameters()]

    out, grads = run()
    monkeypatch.setattr(encoders, "_uint8_to_conv_input", encoders._uint8_to_float)  # the fp32 detour
    ref_out, ref_grads = run()
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


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


def test_shared_layers_are_orthogonal_tanh_layers_over_pixels_and_state_together():
    torch.manual_seed(0)
    enc = ObsEncoder((6, 64, 64), 5, 32, 8, shared_layers=2, shared_dim=16)
    assert enc.out_dim == 16 and [m.weight.shape for m in enc.shared[::2]] == [(16, 40), (16, 16)]
    square = enc.shared[2].weight
    torch.testing.assert_close(square @ square.T, 2.0 * torch.eye(16), rtol=0, atol=1e-5)  # orthogonal, gain sqrt 2
    assert all(m.bias.abs().sum() == 0 for m in enc.shared[::2])
    obs = {"pixels": torch.randint(0, 256, (3, 6, 64, 64), dtype=torch.uint8), "state": torch.randn(3, 5)}
    obs["state"].requires_grad_(True)
    out = enc(obs)
    assert out.shape == (3, 16) and out.abs().max() < 1  # the last layer's tanh
    plain = ObsEncoder((6, 64, 64), 5, 32, 8)
    plain.load_state_dict({k: v for k, v in enc.state_dict().items() if not k.startswith("shared.")})
    torch.testing.assert_close(out, enc.shared(plain(obs)))  # the layers read the concatenated features
    out.sum().backward()
    assert obs["state"].grad.abs().sum() > 0 and enc.pixels.convs[0].weight.grad.abs().sum() > 0
    assert not any(k.startswith("shared.") for k in plain.state_dict())  # 0 layers: old checkpoints' keys


def test_samples_are_independent_of_their_batch():
    """No layer mixes samples: a sample's features do not depend on the others."""
    enc = ObsEncoder((3, 64, 64), 2, 16, 8)
    obs = {"pixels": torch.randint(0, 256, (5, 3, 64, 64), dtype=torch.uint8), "state": torch.randn(5, 2)}
    full = enc(obs)
    part = enc({k: v[2:4] for k, v in obs.items()})
    torch.testing.assert_close(part, full[2:4], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- backbones (issue 6)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

from visppo.encoders import ENCODERS, TorchvisionBackbone  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def _frames(n, c=3, side=32, seed=0):
    return torch.randint(0, 256, (n, c, side, side), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ENCODERS)
def test_every_encoder_builds_and_gives_feature_dim(name):
    side = 48 if name == "nature" else 32
    enc = ObsEncoder((6, side, side), 0, 16, 8, encoder=name)
    out = enc({"pixels": _frames(2, 6, side)})
    assert out.shape == (2, 16) and enc.out_dim == 16
    assert len(enc.trunk_parameters()) > 0


def test_torchvision_head_is_removed():
    enc = TorchvisionBackbone("resnet18", 3, 16)
    assert not hasattr(enc.net, "fc") and enc.trunk_dim == 512
    assert not any(k.startswith("fc.") for k in enc.net.state_dict())
    mob = TorchvisionBackbone("mobilenet_v3_small", 3, 16)
    assert not hasattr(mob.net, "classifier") and mob.trunk_dim == 576


def test_imagenet_normalisation_and_resize():
    torch.manual_seed(0)
    enc = TorchvisionBackbone("resnet18", 3, 16, resize=48)
    x = _frames(2)
    ref_in = F.interpolate(x.float() / 255.0, size=(48, 48), mode="bilinear", align_corners=False)
    ref_in = (ref_in - MEAN) / STD
    net = enc.net
    ref = torch.flatten(net.avgpool(net.layer4(net.layer3(net.layer2(net.layer1(
        net.maxpool(net.relu(net.bn1(net.conv1(ref_in))))))))), 1)
    torch.testing.assert_close(enc.frame_features(x), ref, rtol=1e-4, atol=1e-5)


def test_stacked_frames_go_through_the_backbone_one_by_one():
    """A k=3 stack: the trunk runs on each RGB frame; features concatenated, then projected."""
    torch.manual_seed(0)
    enc = TorchvisionBackbone("resnet18", 9, 16)
    assert enc.net.conv1.in_channels == 3  # the first layer is not changed to take 9 channels
    x = _frames(2, 9)
    per_frame = torch.cat([enc.frame_features(x[:, 3 * i:3 * i + 3]) for i in range(3)], dim=1)
    torch.testing.assert_close(enc(x), enc.proj(per_frame), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="RGB"):
        TorchvisionBackbone("resnet18", 4, 16)


def test_batchnorm_stays_in_eval_mode_and_samples_are_independent():
    torch.manual_seed(0)
    enc = ObsEncoder((3, 32, 32), 0, 16, 8, encoder="resnet18").train()
    bns = [m for m in enc.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns) and enc.pixels.proj.training
    before = [m.running_mean.clone() for m in bns]
    obs = {"pixels": _frames(5)}
    full = enc(obs)
    part = enc({"pixels": obs["pixels"][1:3]})
    torch.testing.assert_close(part, full[1:3], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(b, m.running_mean) for b, m in zip(before, bns, strict=True))


def test_torchvision_channels_last_gives_the_same_features():
    torch.manual_seed(0)
    enc = TorchvisionBackbone("resnet18", 6, 16)
    x = _frames(2, 6)
    ref = enc(x)
    torch.testing.assert_close(enc.to(memory_format=torch.channels_last)(x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["impala", "resnet18", "mobilenet_v3_small"])
def test_checkpointing_gives_the_same_gradients(name, monkeypatch):
    calls = []
    monkeypatch.setattr(encoders, "checkpoint", lambda *a, **k: (calls.append(1), checkpoint(*a, **k))[1])
    torch.manual_seed(0)
    enc = ObsEncoder((6, 32, 32), 0, 16, 8, encoder=name)
    obs = {"pixels": _frames(3, 6)}
    grads = []
    for ckpt in (False, True):
        enc.pixels.checkpointing = ckpt
        enc.zero_grad(set_to_none=True)
        calls.clear()
        enc(obs).pow(2).sum().backward()
        assert (len(calls) > 1) == ckpt  # on: every stage through torch.utils.checkpoint; off: none
        grads.append([p.grad.clone() for p in enc.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_impala_residual_layout():
    enc = ImpalaCNN(3, 64, 32)
    assert len(enc.stages) == 3 and enc(_frames(2, 3, 64)).shape == (2, 32)
    assert isinstance(torchvision.models.get_model("resnet18", weights=None), torch.nn.Module)


def test_drq_keeps_a_35x35_map_at_84_and_bounded_features():
    """DrQ-v2's layout: one stride-2 conv then three stride-1 convs, 84 -> 41 -> 39 -> 37 -> 35."""
    enc = DrQCNN(9, 84, 50)
    x = torch.randint(0, 256, (2, 9, 84, 84), dtype=torch.uint8)
    assert enc.convs[:-1](x.float() / 255).shape == (2, 32, 35, 35)
    out = enc(x)
    assert out.shape == (2, 50) and out.abs().max() <= 1.0  # tanh after LayerNorm
    torch.testing.assert_close(out.mean(), torch.zeros(()), atol=0.2, rtol=0)  # LayerNorm centres
    with pytest.raises(ConfigError, match="15 pixels"):
        DrQCNN(9, 14, 50)


# --------------------------------------------------------------------------- spatial softmax (issue 16)

def test_spatial_softmax_keypoints_are_the_peaks_image_coordinates():
    """A sharp peak at (row r, column c) of a map gives that cell's (x, y) in [-1, 1]; a flat map the centre."""
    from visppo.encoders import SpatialSoftmaxCNN

    enc = SpatialSoftmaxCNN(3, 36, 8, keypoints=2)  # (36 - 8) // 4 + 1 = 8x8 maps
    maps = torch.zeros(1, 2, 8, 8)
    maps[0, 0, 1, 6] = 100.0  # keypoint 0: row 1, column 6
    xy = enc.keypoint_xy(maps)  # keypoint 1's map is flat
    grid = torch.linspace(-1, 1, 8)
    torch.testing.assert_close(xy, torch.tensor([[grid[6], 0.0, grid[1], 0.0]]), atol=1e-5, rtol=0)
    # the expectation lies between cells: two equal peaks give their midpoint
    maps[0, 0, 1, 4] = 100.0
    torch.testing.assert_close(enc.keypoint_xy(maps)[0, 0], (grid[4] + grid[6]) / 2, atol=1e-5, rtol=0)


def test_keypoint_count_and_stride_shape_the_maps():
    """model.keypoints sets the maps (two coordinates each); model.keypoint_stride the first conv's
    stride and so the maps' side, and the coordinate grid follows it: a peak in the last column is x = 1."""
    from visppo.encoders import SpatialSoftmaxCNN

    enc = SpatialSoftmaxCNN(9, 84, 16, keypoints=128, stride=2)
    maps = enc.convs(torch.rand(2, 9, 84, 84))
    assert maps.shape == (2, 128, 39, 39) and enc.proj[0].in_features == 256
    peak = torch.zeros(1, 128, 39, 39)
    peak[0, :, 5, 38] = 100.0
    torch.testing.assert_close(enc.keypoint_xy(peak)[0, 0], torch.tensor(1.0), atol=1e-5, rtol=0)
    assert enc(torch.randint(0, 256, (2, 9, 84, 84), dtype=torch.uint8)).shape == (2, 16)
    assert SpatialSoftmaxCNN(9, 84, 16).convs(torch.rand(1, 9, 84, 84)).shape[-1] == 20


def test_spatial_softmax_follows_a_moving_object():
    """With the trunk set to detect red, the keypoint moves with a red square across the frame."""
    from visppo.encoders import SpatialSoftmaxCNN

    enc = SpatialSoftmaxCNN(3, 64, 8, keypoints=1)
    with torch.no_grad():
        for conv in enc.convs[::2]:
            conv.weight.zero_()
            if conv.bias is not None:
                conv.bias.zero_()
        enc.convs[0].weight[0, 0] = 1.0 / 64  # channel 0 of layer 1: mean red over its 8x8 window
        enc.convs[2].weight[0, 0, 1, 1] = 1.0  # layer 2 passes it on
        enc.convs[4].weight[0, 0] = 50.0  # keypoint map: sharp
    xs = []
    for col in (8, 28, 48):
        frame = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
        frame[0, 0, 28:36, col:col + 8] = 255
        xs.append(enc.keypoint_xy(enc.convs(frame.float() / 255))[0, 0].item())
    assert xs[0] < -0.4 and abs(xs[1]) < 0.2 and xs[2] > 0.4, xs
