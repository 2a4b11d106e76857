"""Tensors cross the grading channel on their device: the trusted tests build their inputs on
the learner's DEVICE (cuda when present), and the learner's code must get them there, not on
the CPU (a cache made on cuda, written with keys that arrived on the CPU, mixes devices). No
GPU here: the 'meta' device stands in for one, and an unusable device falls back to the CPU."""
from __future__ import annotations

import torch

from autograder.protocol import wire


def test_a_cpu_tensor_crosses_as_before() -> None:
    node = wire.Encoder(lambda o, d: None).encode(torch.arange(3))
    assert len(node["$tensor"]) == 3
    got = wire.Decoder(lambda *a: None).decode(node)
    assert got.device.type == "cpu" and got.tolist() == [0, 1, 2]


def test_the_encoder_records_a_tensors_device(monkeypatch) -> None:
    # A meta tensor has no bytes to read: the bytes are stubbed, the device is what is checked.
    monkeypatch.setattr(wire, "_tensor_bytes", lambda t: ("float32", list(t.shape), ""))
    node = wire.Encoder(lambda o, d: None).encode(torch.empty(0, device="meta"))
    assert node["$tensor"][3] == "meta"


def test_the_decoder_puts_a_tensor_back_on_its_device(monkeypatch) -> None:
    node = wire.Encoder(lambda o, d: None).encode(torch.ones(2, 3))
    node["$tensor"].append("meta")
    decoder = wire.Decoder(lambda *a: None)
    assert decoder.decode(node).device.type == "cpu"        # meta is not a device tensors go to
    monkeypatch.setattr(wire, "PLACED_DEVICES", ("meta",))
    got = decoder.decode(node)
    assert got.device.type == "meta" and tuple(got.shape) == (2, 3)


def test_a_device_this_process_cannot_use_leaves_the_tensor_on_the_cpu() -> None:
    node = wire.Encoder(lambda o, d: None).encode(torch.ones(2))
    node["$tensor"].append(f"cuda:{torch.cuda.device_count() + 3}")
    got = wire.Decoder(lambda *a: None).decode(node)
    assert got.device.type == "cpu" and got.tolist() == [1.0, 1.0]
    node["$tensor"][3] = "not a device"
    assert wire.Decoder(lambda *a: None).decode(node).device.type == "cpu"
