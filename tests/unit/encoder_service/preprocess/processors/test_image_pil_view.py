"""``rgb_view``: PIL's own pixel memory as a tensor (zero-copy), or a copy where Pillow cannot export it."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from cluster.bench.media import make_image_array
from encoder_service.preprocess.processors.pil_view import rgb_view


@pytest.mark.parametrize(("w", "h", "zero_copy"), [(64, 48, True), (1, 1, True), (2100, 2100, False)])
def test_view_holds_the_image_pixels(w, h, zero_copy):
    """Small images export zero-copy (4 channels, the 4th is padding); an image in several memory
    blocks (over Pillow's 16 MB block) falls back to a 3-channel copy. Both read the same pixels."""
    img = Image.fromarray(make_image_array(w, h, seed=2))
    view, keepalive = rgb_view(img)
    assert view.shape == (1, 4 if zero_copy else 3, h, w) and (keepalive is not None) == zero_copy
    assert np.array_equal(view[0, :3].permute(1, 2, 0).numpy(), np.asarray(img))


def test_view_shares_memory_with_the_image():
    img = Image.new("RGB", (8, 4), (1, 2, 3))
    view, keepalive = rgb_view(img)
    img.putpixel((5, 2), (200, 100, 50))  # a write through PIL shows in the view: no copy was made
    assert view[0, :3, 2, 5].tolist() == [200, 100, 50] and keepalive is not None


def test_view_refuses_other_modes():
    with pytest.raises(ValueError, match="expected an RGB image"):
        rgb_view(Image.new("L", (4, 4)))
