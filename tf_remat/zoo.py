"""Model zoo: the Checkmate set (VGG16, VGG19, MobileNet, ResNet50, U-Net, FCN8-VGG, SegNet), a
Transformer encoder and a small BatchNorm CNN, as Keras 3 models with ``weights=None`` (nothing
is downloaded), compiled with a default loss and optimizer so ``extract(model, loss=None,
optimizer=None, ...)`` works.

Every builder is ``f(batch_size, input_size, num_classes) -> (model, input_spec, label_spec)``;
use :func:`get_model` / :func:`model_specs` by name. ``input_size`` is ``H`` or ``(H, W)`` or
``"HxW"`` for images, the sequence length for the Transformer.

Example:
    >>> model, x_spec, y_spec = model_specs("resnet50", batch_size=8)  # doctest: +SKIP
    >>> graph = tf_remat.extract_graph(model, input_spec=x_spec,  # doctest: +SKIP
    ...                                label_spec=y_spec)
"""

from __future__ import annotations

from typing import Callable

__all__ = ["MODELS", "get_model", "model_specs", "parse_input_size", "default_input_size"]


def parse_input_size(value, default):
    """``224``, ``"224"``, ``"224x160"``, ``(224, 160)`` -> ``(H, W)``; None -> ``default``."""
    if value is None or value == "":
        value = default
    if isinstance(value, str):
        parts = value.lower().replace("*", "x").split("x")
        try:
            nums = [int(p) for p in parts if p.strip()]
        except ValueError as exc:
            raise ValueError(f"input size {value!r} is not H or HxW (e.g. 224 or 224x224)") \
                from exc
        value = nums
    if isinstance(value, int):
        return (value, value)
    value = tuple(int(v) for v in value)
    if len(value) == 1:
        return (value[0], value[0])
    if len(value) != 2 or min(value) <= 0:
        raise ValueError(f"input size {value!r} must be H or (H, W) with positive sizes")
    return value


# --------------------------------------------------------------------- builders
def _compile(model, *, lr=1e-3):
    import keras

    model.compile(optimizer=keras.optimizers.Adam(learning_rate=lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _classification_specs(batch, hw, channels=3):
    import tensorflow as tf

    return (tf.TensorSpec((batch, hw[0], hw[1], channels), tf.float32),
            tf.TensorSpec((batch,), tf.int32))


def _segmentation_specs(batch, hw, channels=3):
    import tensorflow as tf

    return (tf.TensorSpec((batch, hw[0], hw[1], channels), tf.float32),
            tf.TensorSpec((batch, hw[0], hw[1]), tf.int32))


def _app(factory_name):
    def build(batch_size, input_size, num_classes):
        import keras

        hw = parse_input_size(input_size, 224)
        factory = getattr(keras.applications, factory_name)
        model = factory(weights=None, input_shape=(hw[0], hw[1], 3), classes=num_classes,
                        classifier_activation=None)
        return (_compile(model),) + _classification_specs(batch_size, hw)

    build.__name__ = factory_name.lower()
    return build


def _check_divisible(hw, k, name):
    if hw[0] % k or hw[1] % k:
        raise ValueError(f"{name} needs an input size divisible by {k}, got {hw[0]}x{hw[1]}")


def unet(batch_size, input_size=None, num_classes=2, *, base=64, depth=4):
    """U-Net (Ronneberger et al. 2015), same-padded, BatchNorm-free, 2 convs per level."""
    import keras
    from keras import layers

    hw = parse_input_size(input_size, 256)
    _check_divisible(hw, 2 ** depth, "unet")
    inp = keras.Input((hw[0], hw[1], 3))
    h, skips = inp, []
    for d in range(depth):
        f = base * 2 ** d
        h = layers.Conv2D(f, 3, padding="same", activation="relu", name=f"down{d}_conv1")(h)
        h = layers.Conv2D(f, 3, padding="same", activation="relu", name=f"down{d}_conv2")(h)
        skips.append(h)
        h = layers.MaxPooling2D(name=f"down{d}_pool")(h)
    f = base * 2 ** depth
    h = layers.Conv2D(f, 3, padding="same", activation="relu", name="mid_conv1")(h)
    h = layers.Conv2D(f, 3, padding="same", activation="relu", name="mid_conv2")(h)
    for d in reversed(range(depth)):
        f = base * 2 ** d
        h = layers.Conv2DTranspose(f, 2, strides=2, padding="same", name=f"up{d}_deconv")(h)
        h = layers.Concatenate(name=f"up{d}_concat")([skips[d], h])
        h = layers.Conv2D(f, 3, padding="same", activation="relu", name=f"up{d}_conv1")(h)
        h = layers.Conv2D(f, 3, padding="same", activation="relu", name=f"up{d}_conv2")(h)
    out = layers.Conv2D(num_classes, 1, name="logits")(h)
    model = keras.Model(inp, out, name="unet")
    return (_compile(model),) + _segmentation_specs(batch_size, hw)


def _vgg_features(x, blocks, name="block"):
    from keras import layers

    feats = []
    for b, (n, f) in enumerate(blocks, start=1):
        for c in range(1, n + 1):
            x = layers.Conv2D(f, 3, padding="same", activation="relu",
                              name=f"{name}{b}_conv{c}")(x)
        x = layers.MaxPooling2D(name=f"{name}{b}_pool")(x)
        feats.append(x)
    return feats


_VGG16 = ((2, 64), (2, 128), (3, 256), (3, 512), (3, 512))


def fcn8(batch_size, input_size=None, num_classes=21):
    """FCN-8s over a VGG16 backbone (Long et al. 2015): fc6/fc7 as convolutions, score layers
    at pool3/pool4/fc7, learned 2x/2x/8x upsampling with skip additions."""
    import keras
    from keras import layers

    hw = parse_input_size(input_size, 224)
    _check_divisible(hw, 32, "fcn8")
    inp = keras.Input((hw[0], hw[1], 3))
    feats = _vgg_features(inp, _VGG16)
    pool3, pool4, pool5 = feats[2], feats[3], feats[4]
    h = layers.Conv2D(4096, 7, padding="same", activation="relu", name="fc6")(pool5)
    h = layers.Dropout(0.5, name="drop6")(h)
    h = layers.Conv2D(4096, 1, activation="relu", name="fc7")(h)
    h = layers.Dropout(0.5, name="drop7")(h)
    score7 = layers.Conv2D(num_classes, 1, name="score_fr")(h)
    up2 = layers.Conv2DTranspose(num_classes, 4, strides=2, padding="same",
                                 use_bias=False, name="upscore2")(score7)
    score4 = layers.Conv2D(num_classes, 1, name="score_pool4")(pool4)
    fuse4 = layers.Add(name="fuse_pool4")([up2, score4])
    up4 = layers.Conv2DTranspose(num_classes, 4, strides=2, padding="same",
                                 use_bias=False, name="upscore_pool4")(fuse4)
    score3 = layers.Conv2D(num_classes, 1, name="score_pool3")(pool3)
    fuse3 = layers.Add(name="fuse_pool3")([up4, score3])
    out = layers.Conv2DTranspose(num_classes, 16, strides=8, padding="same",
                                 use_bias=False, name="upscore8")(fuse3)
    model = keras.Model(inp, out, name="fcn8")
    return (_compile(model, lr=1e-4),) + _segmentation_specs(batch_size, hw)


def segnet(batch_size, input_size=None, num_classes=12):
    """SegNet (Badrinarayanan et al. 2017): VGG16 encoder with BatchNorm, a mirrored decoder
    (upsampling in place of max-unpooling, as in Checkmate's Keras SegNet)."""
    import keras
    from keras import layers

    hw = parse_input_size(input_size, 224)
    _check_divisible(hw, 32, "segnet")
    inp = keras.Input((hw[0], hw[1], 3))
    h = inp
    for b, (n, f) in enumerate(_VGG16, start=1):
        for c in range(1, n + 1):
            h = layers.Conv2D(f, 3, padding="same", use_bias=False, name=f"enc{b}_conv{c}")(h)
            h = layers.BatchNormalization(name=f"enc{b}_bn{c}")(h)
            h = layers.Activation("relu", name=f"enc{b}_relu{c}")(h)
        h = layers.MaxPooling2D(name=f"enc{b}_pool")(h)
    dec = ((3, 512, 512), (3, 512, 256), (3, 256, 128), (2, 128, 64), (2, 64, 64))
    for b, (n, f, f_last) in enumerate(dec, start=1):
        h = layers.UpSampling2D(name=f"dec{b}_up")(h)
        for c in range(1, n + 1):
            h = layers.Conv2D(f if c < n else f_last, 3, padding="same", use_bias=False,
                              name=f"dec{b}_conv{c}")(h)
            h = layers.BatchNormalization(name=f"dec{b}_bn{c}")(h)
            h = layers.Activation("relu", name=f"dec{b}_relu{c}")(h)
    out = layers.Conv2D(num_classes, 1, name="logits")(h)
    model = keras.Model(inp, out, name="segnet")
    return (_compile(model),) + _segmentation_specs(batch_size, hw)


def transformer(batch_size, input_size=None, num_classes=2, *, layers_=4, d_model=256,
                heads=8, d_ff=1024, vocab=8000, dropout=0.1):
    """A Transformer encoder classifier: token + position embeddings, ``layers_`` post-norm
    blocks of multi-head self-attention, Dropout, LayerNorm and a ReLU feed-forward, mean
    pooling, a dense head. ``input_size`` is the sequence length (default 128)."""
    import keras
    import tensorflow as tf
    from keras import layers

    seq = input_size if isinstance(input_size, int) else (
        parse_input_size(input_size, 128)[0] if input_size is not None else 128)
    tokens = keras.Input((seq,), dtype="int32")
    h = layers.Embedding(vocab, d_model, name="tok_embed")(tokens)
    pos = layers.Embedding(seq, d_model, name="pos_embed")(
        keras.ops.arange(seq, dtype="int32")[None, :])
    h = layers.Add(name="embed")([h, pos])
    h = layers.Dropout(dropout, name="embed_drop")(h)
    for i in range(layers_):
        a = layers.MultiHeadAttention(heads, d_model // heads, dropout=dropout,
                                      name=f"l{i}_mha")(h, h)
        a = layers.Dropout(dropout, name=f"l{i}_drop1")(a)
        h = layers.LayerNormalization(name=f"l{i}_ln1")(layers.Add(name=f"l{i}_res1")([h, a]))
        f = layers.Dense(d_ff, activation="relu", name=f"l{i}_ff1")(h)
        f = layers.Dense(d_model, name=f"l{i}_ff2")(f)
        f = layers.Dropout(dropout, name=f"l{i}_drop2")(f)
        h = layers.LayerNormalization(name=f"l{i}_ln2")(layers.Add(name=f"l{i}_res2")([h, f]))
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    out = layers.Dense(num_classes, name="logits")(h)
    model = keras.Model(tokens, out, name="transformer")
    _compile(model, lr=1e-4)
    return model, tf.TensorSpec((batch_size, seq), tf.int32), \
        tf.TensorSpec((batch_size,), tf.int32)


def bn_cnn(batch_size, input_size=None, num_classes=10, *, widths=(32, 64, 128), convs=2):
    """A small CNN: per stage ``convs`` 3x3 conv + BatchNorm + ReLU, max pooling, Dropout; dense
    head. Named ``bn_cnn`` with two convolutions per stage, ``bn_cnn<layers>`` otherwise."""
    import keras
    from keras import layers

    hw = parse_input_size(input_size, 32)
    inp = keras.Input((hw[0], hw[1], 3))
    h = inp
    for s, w in enumerate(widths):
        for c in range(convs):
            h = layers.Conv2D(w, 3, padding="same", name=f"s{s}_conv{c}")(h)
            h = layers.BatchNormalization(name=f"s{s}_bn{c}")(h)
            h = layers.Activation("relu", name=f"s{s}_relu{c}")(h)
        h = layers.MaxPooling2D(name=f"s{s}_pool")(h)
        h = layers.Dropout(0.2, name=f"s{s}_drop")(h)
    h = layers.Flatten(name="flatten")(h)
    h = layers.Dense(256, activation="relu", name="fc1")(h)
    out = layers.Dense(num_classes, name="logits")(h)
    name = "bn_cnn" if convs == 2 else f"bn_cnn{convs * len(widths)}"
    model = keras.Model(inp, out, name=name)
    return (_compile(model),) + _classification_specs(batch_size, hw)


def _bn_cnn12(batch_size, input_size=None, num_classes=10):
    """:func:`bn_cnn` with four convolutions per stage (12 in all): deep enough that a plan has
    activations to trade (the demo's default; the 6-layer net's smallest possible peak, one
    BatchNorm gradient's inputs and output, is 48% of its step's, so 60% left no room for the
    allocator's rounding)."""
    return bn_cnn(batch_size, input_size, num_classes, convs=4)


MODELS: dict[str, Callable] = {
    "vgg16": _app("VGG16"),
    "vgg19": _app("VGG19"),
    "mobilenet": _app("MobileNet"),
    "resnet50": _app("ResNet50"),
    "unet": unet,
    "fcn8": fcn8,
    "segnet": segnet,
    "transformer": transformer,
    "bn_cnn": bn_cnn,
    "bn_cnn12": _bn_cnn12,
}
_DEFAULT_CLASSES = {"unet": 2, "fcn8": 21, "segnet": 12, "transformer": 2, "bn_cnn": 10,
                    "bn_cnn12": 10}
_DEFAULT_INPUT = {"unet": 256, "transformer": 128, "bn_cnn": 32, "bn_cnn12": 32}


def default_input_size(name: str) -> int:
    return _DEFAULT_INPUT.get(name, 224)


def get_model(name: str, batch_size: int = 8, input_size=None, num_classes: int | None = None):
    """The zoo model ``name`` (compiled), with its input and label ``tf.TensorSpec``.

    Args:
        name: one of :data:`MODELS` (case-insensitive; ``-`` and ``_`` alike).
        batch_size: the fixed batch size of the specs.
        input_size: image size (``224``, ``"224x160"``, ``(224, 160)``) or sequence length.
        num_classes: output classes (default: 1000 for ImageNet models, the dataset's for
            segmentation models).

    Returns:
        ``(model, input_spec, label_spec)``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or a bad size.
    """
    key = name.lower().replace("-", "_")
    if key in ("fcn8_vgg", "fcn"):
        key = "fcn8"
    if key not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(MODELS)}")
    if batch_size is None or int(batch_size) <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    classes = num_classes if num_classes is not None else _DEFAULT_CLASSES.get(key, 1000)
    return MODELS[key](int(batch_size), input_size, int(classes))


def model_specs(name: str, batch_size: int = 8, input_size=None, num_classes=None):
    """Same as :func:`get_model` (the name the CLI uses)."""
    return get_model(name, batch_size=batch_size, input_size=input_size,
                     num_classes=num_classes)
