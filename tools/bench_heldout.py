#!/usr/bin/env python
"""Held-out-style check of ``tf_remat.optimize`` -> benchmarks/results/heldout.md.

The models here are not in the zoo (``tf_remat.zoo``) and have what the held-out check names:
skip connections (additions and concatenations), BatchNorm and Dropout. Per model, in a fresh
process: the plain training step's peak is measured (median of 3 runs, as
``tools/bench_rewrite.py`` measures it), ``tf_remat.optimize`` runs with its defaults (``auto``,
profiled costs, verification on) at 60% and 70% of that peak, and the rewritten step is then
measured again in allocation histories ``optimize`` never saw:

* **fresh**: ``step.measure`` right after ``optimize`` (3 runs, the worst);
* **after fit**: after ``model.fit`` trained 2 epochs with the rewritten step;
* **fragmented**: with a dozen tensors of 5-50% of the largest activation allocated and every
  other one freed, so the allocator's free chunks are of odd sizes;
* **first call**: a model built, compiled and optimized anew in a process where the plain
  Keras step already ran (``model.train_on_batch``), the rewritten step's first call timed.

The worst of these over the budget is what a user can see; the check allows 5% slack. The
gradients (``step.gradients`` vs the plain step's, same state and batch), the BatchNorm
moving statistics and every variable a step changes, after one step, are compared too.

Usage:
    python tools/bench_heldout.py                    # every model
    python tools/bench_heldout.py --models resdrop mixer --fractions 0.6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FRACTIONS = (0.6, 0.7)
MIB = 2**20


# --------------------------------------------------------------------- models
def resdrop(batch=64, hw=32):
    """Pre-activation residual CNN: strided projection shortcuts, BatchNorm, Dropout."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
    for width, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2)):
        r = keras.layers.BatchNormalization()(h)
        r = keras.layers.Activation("relu")(r)
        s = h if stride == 1 and h.shape[-1] == width else \
            keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(r)
        r = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("relu")(r)
        r = keras.layers.Dropout(0.2)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        h = keras.layers.Add()([r, s])
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.BatchNormalization()(h))
    out = keras.layers.Dense(10)(keras.layers.Dropout(0.3)(h))
    model = keras.Model(inp, out, name="resdrop")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def mixed(batch=64, hw=32):
    """A residual CNN under Keras's ``mixed_bfloat16`` policy (bfloat16 activations, float32
    weights; each BatchNormalization casts to float32 for its statistics), Dropout, a float32
    head."""
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inp = keras.Input((hw, hw, 3))
        h = keras.layers.Conv2D(32, 3, padding="same")(inp)
        for width, stride in ((32, 1), (32, 1), (64, 2), (64, 1)):
            r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
            s = h if stride == 1 and h.shape[-1] == width else \
                keras.layers.Conv2D(width, 1, strides=stride)(r)
            r = keras.layers.Conv2D(width, 3, strides=stride, padding="same")(r)
            r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
            r = keras.layers.Dropout(0.1)(r)
            r = keras.layers.Conv2D(width, 3, padding="same")(r)
            h = keras.layers.Add()([r, s])
        h = keras.layers.GlobalAveragePooling2D()(h)
        out = keras.layers.Dense(10, dtype="float32")(h)
        model = keras.Model(inp, out, name="mixed")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def unet_bn(batch=8, hw=64):
    """A small U-Net: concatenated skips, BatchNorm, Dropout at the bottleneck, per-pixel loss."""
    import keras
    import tensorflow as tf

    def block(x, width):
        for _ in range(2):
            x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.Activation("relu")(x)
        return x

    inp = keras.Input((hw, hw, 3))
    skips, h = [], inp
    for width in (16, 32, 64):
        h = block(h, width)
        skips.append(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Dropout(0.3)(block(h, 128))
    for width, skip in zip((64, 32, 16), reversed(skips)):
        h = keras.layers.Conv2DTranspose(width, 2, strides=2)(h)
        h = block(keras.layers.Concatenate()([h, skip]), width)
    out = keras.layers.Conv2D(3, 1)(h)
    model = keras.Model(inp, out, name="unet_bn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, hw, hw), tf.int32)


def densenet(batch=8, hw=64):
    """keras.applications.DenseNet121 (weights=None): concatenation everywhere, BatchNorm."""
    import keras
    import tensorflow as tf

    model = keras.applications.DenseNet121(weights=None, input_shape=(hw, hw, 3), classes=10,
                                           classifier_activation=None)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def efficientnet(batch=8, hw=64):
    """keras.applications.EfficientNetB0 (weights=None): residual adds, squeeze-excitation
    products, BatchNorm, stochastic-depth Dropout (noise_shape) and a top Dropout."""
    import keras
    import tensorflow as tf

    model = keras.applications.EfficientNetB0(weights=None, input_shape=(hw, hw, 3),
                                              classes=10, classifier_activation=None)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def mixer(batch=32, patches=64, dim=128, depth=4):
    """An MLP-Mixer over a token sequence: LayerNorm, Dropout, residual adds, transposes."""
    import keras
    import tensorflow as tf

    inp = keras.Input((patches, dim))
    h = inp
    for _ in range(depth):
        t = keras.layers.LayerNormalization()(h)
        t = keras.layers.Permute((2, 1))(t)
        t = keras.layers.Dense(2 * patches, activation="gelu")(t)
        t = keras.layers.Dropout(0.1)(t)
        t = keras.layers.Permute((2, 1))(keras.layers.Dense(patches)(t))
        h = keras.layers.Add()([h, t])
        c = keras.layers.LayerNormalization()(h)
        c = keras.layers.Dense(4 * dim, activation="gelu")(c)
        c = keras.layers.Dropout(0.1)(c)
        h = keras.layers.Add()([h, keras.layers.Dense(dim)(c)])
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(h))
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out, name="mixer")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3))
    return model, tf.TensorSpec((batch, patches, dim)), tf.TensorSpec((batch,), tf.int32)


def vit(batch=32, hw=32, patch=4, dim=96, heads=4, depth=4):
    """A small vision transformer: a strided Conv2D patch stem with BatchNorm, a learned
    position embedding, pre-norm blocks of MultiHeadAttention (attention-probability Dropout)
    and a GELU MLP with Dropout, residual adds, a class head on the mean token."""
    import keras
    import tensorflow as tf

    tokens = (hw // patch) ** 2
    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(dim, patch, strides=patch, use_bias=False)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Reshape((tokens, dim))(h)
    pos = keras.layers.Embedding(tokens, dim)(keras.ops.arange(tokens)[None])
    h = keras.layers.Add()([h, pos])
    for _ in range(depth):
        a = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=0.1)(a, a)
        h = keras.layers.Add()([h, keras.layers.Dropout(0.1)(a)])
        m = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        m = keras.layers.Dense(2 * dim, activation="gelu")(m)
        m = keras.layers.Dropout(0.1)(m)
        h = keras.layers.Add()([h, keras.layers.Dense(dim)(m)])
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(epsilon=1e-6)(h))
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out, name="vit")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def twotower(batch=32, hw=32, features=24):
    """Two inputs (an image and a feature vector, as a dict) and two outputs (a class and a
    regression target, each with its own loss and weight): a residual conv tower with
    BatchNorm and Dropout beside an MLP tower, concatenated."""
    import keras
    import tensorflow as tf

    img = keras.Input((hw, hw, 3), name="image")
    feats = keras.Input((features,), name="meta")
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(img)
    for width, stride in ((32, 1), (64, 2), (64, 1), (96, 2)):
        r = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(h)
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
        r = keras.layers.Dropout(0.1)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        s = h if stride == 1 and h.shape[-1] == width else \
            keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(h)
        h = keras.layers.Activation("relu")(keras.layers.Add()([r, s]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    m = keras.layers.Dense(64, activation="relu")(feats)
    m = keras.layers.Dropout(0.2)(keras.layers.BatchNormalization()(m))
    z = keras.layers.Concatenate()([h, m])
    z = keras.layers.Dense(128, activation="relu")(z)
    model = keras.Model({"image": img, "meta": feats},
                        {"cls": keras.layers.Dense(10, name="cls")(z),
                         "aux": keras.layers.Dense(1, name="aux")(z)}, name="twotower")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "aux": "mse"}, loss_weights={"cls": 1.0, "aux": 0.3})
    return (model, {"image": tf.TensorSpec((batch, hw, hw, 3)),
                    "meta": tf.TensorSpec((batch, features))},
            {"cls": tf.TensorSpec((batch,), tf.int32), "aux": tf.TensorSpec((batch, 1))})


def siamese(batch=32, hw=32):
    """One conv encoder (BatchNorm, Dropout, a residual add) applied to two images, a list of
    two inputs: shared weights get the sum of both branches' gradients, and each BatchNorm
    updates its moving statistics twice in one step, in an order the rewrite must keep."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inp)
    for width in (32, 64):
        r = keras.layers.Conv2D(width, 3, strides=2, padding="same", use_bias=False)(h)
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
        r = keras.layers.Dropout(0.1)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        s = keras.layers.Conv2D(width, 1, strides=2, use_bias=False)(h)
        h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(
            keras.layers.Add()([r, s])))
    encoder = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(h), name="encoder")
    a, b = keras.Input((hw, hw, 3)), keras.Input((hw, hw, 3))
    ea, eb = encoder(a), encoder(b)
    d = keras.layers.Concatenate()([keras.ops.abs(ea - eb), ea * eb])
    d = keras.layers.Dropout(0.2)(keras.layers.Dense(64, activation="relu")(d))
    model = keras.Model([a, b], keras.layers.Dense(2)(d), name="siamese")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    spec = tf.TensorSpec((batch, hw, hw, 3))
    return model, [spec, spec], tf.TensorSpec((batch,), tf.int32)


def decoder_gn(batch=16, hw=64):
    """An encoder-decoder: strided convolutions with GroupNorm and SiLU down, 3x3 stride-2
    Conv2DTranspose with BatchNorm up, concatenated skips, Dropout at the bottleneck,
    per-pixel loss."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h, skips = inp, []
    for width in (32, 64):
        h = keras.layers.Conv2D(width, 3, strides=2, padding="same")(h)
        h = keras.layers.GroupNormalization(8)(h)
        h = keras.layers.Activation("silu")(h)
        skips.append(h)
    h = keras.layers.Dropout(0.2)(h)
    for width, skip in zip((32, 16), reversed(skips)):
        h = keras.layers.Concatenate()([h, skip])
        h = keras.layers.Conv2DTranspose(width, 3, strides=2, padding="same")(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
    out = keras.layers.Conv2D(3, 3, padding="same")(h)
    model = keras.Model(inp, out, name="decoder_gn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, hw, hw), tf.int32)


def noisy(batch=32, hw=32):
    """Residual CNN with the training-time random layers: RandomFlip, GaussianNoise,
    GaussianDropout (a random normal mask per activation), AlphaDropout; BatchNorm."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.RandomFlip("horizontal")(inp)
    h = keras.layers.GaussianNoise(0.1)(h)
    h = keras.layers.Conv2D(32, 3, padding="same")(h)
    for width in (32, 64, 64):
        r = keras.layers.BatchNormalization()(h)
        r = keras.layers.Activation("relu")(r)
        r = keras.layers.Conv2D(width, 3, padding="same")(r)
        r = keras.layers.GaussianDropout(0.1)(r)
        r = keras.layers.Conv2D(width, 3, padding="same")(r)
        s = h if h.shape[-1] == width else keras.layers.Conv2D(width, 1)(h)
        h = keras.layers.Add()([r, s])
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(10)(keras.layers.AlphaDropout(0.1)(h))
    model = keras.Model(inp, out, name="noisy")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def bilstm(batch=32, steps=64, features=32):
    """Bidirectional LSTM, Dropout, LSTM (no ``unroll``: tf.while_loops whose TensorLists the
    graph sizes from the loop bodies)."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps, features))
    h = keras.layers.Bidirectional(keras.layers.LSTM(128, return_sequences=True))(inp)
    h = keras.layers.LSTM(64)(keras.layers.Dropout(0.2)(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="bilstm")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, steps, features)), tf.TensorSpec((batch,), tf.int32)


def lstmconv(batch=32, steps=128, vocab=1000, dim=128):
    """Embedding, a Bidirectional LSTM whose output later blocks concatenate back in, Dense +
    BatchNorm, Conv1D + BatchNorm + SpatialDropout1D residual blocks, GlobalMaxPooling1D,
    Dropout, SGD: a random sequence model of a search for gaps (the loop's many small
    TensorList buffers beside 2 MiB activations put its first plans 25-36% over their
    prediction, and the re-solve after them far under the target)."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps,), dtype="int32")
    e = keras.layers.Embedding(vocab, dim)(inp)
    r = keras.layers.Bidirectional(keras.layers.LSTM(dim // 2, return_sequences=True))(e)
    h = r
    for _ in range(2):
        h = keras.layers.Dense(dim)(keras.layers.Concatenate()([h, e]))
        h = keras.layers.BatchNormalization()(h)
    for _ in range(2):
        c = keras.layers.Conv1D(dim, 5, padding="causal", dilation_rate=2)(h)
        c = keras.layers.SpatialDropout1D(0.1)(
            keras.layers.Activation("relu")(keras.layers.BatchNormalization()(c)))
        h = keras.layers.Dense(dim)(keras.layers.Concatenate()([keras.layers.Add()([c, h]), r]))
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3)(keras.layers.GlobalMaxPooling1D()(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="lstmconv")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch,), tf.int32)


def textcnn(batch=32, steps=128, vocab=2000):
    """Token ids through an Embedding, three dilated Conv1D residual blocks (BatchNorm, GELU,
    Dropout), LayerNorm, max and mean pooling concatenated, RMSprop: the embedding's gradient
    is IndexedSlices, which RMSprop updates from through data-dependent shapes."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((steps,), dtype="int32")
    h = L.Embedding(vocab, 64)(inp)
    for rate in (1, 2, 4):
        r = L.Conv1D(64, 5, padding="same", dilation_rate=rate)(h)
        r = L.Dropout(0.2)(L.Activation("gelu")(L.BatchNormalization()(r)))
        h = L.Add()([h, r])
    h = L.LayerNormalization()(h)
    h = L.Concatenate()([L.GlobalMaxPooling1D()(h), L.GlobalAveragePooling1D()(h)])
    model = keras.Model(inp, L.Dense(2)(L.Dropout(0.3)(h)), name="textcnn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.RMSprop(1e-3))
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch,), tf.int32)


def senet(batch=32, hw=32):
    """Residual blocks with squeeze-and-excitation (pooled Dense gates multiplied back in), a
    DepthwiseConv2D, SpatialDropout2D and BatchNorm; ZeroPadding2D, MaxPooling2D, Flatten and
    Dropout before the head; SGD with momentum."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((hw, hw, 3))
    h = L.Activation("swish")(L.BatchNormalization()(L.Conv2D(32, 3)(L.ZeroPadding2D(1)(inp))))
    for f in (32, 64, 64):
        stride = 2 if f != h.shape[-1] else 1
        r = L.ReLU()(L.BatchNormalization()(L.Conv2D(f, 3, strides=stride, padding="same")(h)))
        r = L.SpatialDropout2D(0.1)(r)
        r = L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same")(r))
        gate = L.GlobalAveragePooling2D()(r)
        gate = L.Dense(f, activation="sigmoid")(L.Dense(f // 4, activation="relu")(gate))
        r = L.Multiply()([r, L.Reshape((1, 1, f))(gate)])
        if stride > 1:
            h = L.Conv2D(f, 1, strides=stride)(h)
        h = L.ReLU()(L.Add()([h, r]))
    h = L.Dropout(0.3)(L.Flatten()(L.MaxPooling2D()(h)))
    model = keras.Model(inp, L.Dense(10)(h), name="senet")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def fpn(batch=8, hw=64):
    """A feature pyramid: strided Conv2D-BatchNorm stages, a nearest-upsampled top-down add, a
    Conv2DTranspose joined to the first stage by concatenation, LayerNorm, per-pixel classes,
    AdamW."""
    import keras
    import tensorflow as tf

    L = keras.layers

    def stage(h, f, s):
        return L.ReLU()(L.BatchNormalization()(L.Conv2D(f, 3, strides=s, padding="same")(h)))

    inp = keras.Input((hw, hw, 3))
    c1 = stage(inp, 16, 1)
    c2 = stage(c1, 32, 2)
    c3 = L.Dropout(0.2)(stage(c2, 64, 2))
    p2 = L.Add()([L.UpSampling2D()(L.Conv2D(32, 1)(c3)), L.Conv2D(32, 1)(c2)])
    p1 = L.Conv2DTranspose(16, 3, strides=2, padding="same")(p2)
    p1 = L.BatchNormalization()(L.Concatenate()([p1, c1]))
    p1 = L.LayerNormalization()(L.Conv2D(16, 3, padding="same", activation="elu")(p1))
    model = keras.Model(inp, L.Conv2D(4, 1)(p1), name="fpn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, hw, hw), tf.int32)


def conv3d(batch=8, frames=8, hw=32):
    """A video net: Conv3D with BatchNorm and Dropout, a residual add, MaxPooling3D, a
    concatenated skip, global average pooling."""
    import keras
    import tensorflow as tf

    L = keras.layers

    def block(h, f):
        return L.ReLU()(L.BatchNormalization()(L.Conv3D(f, 3, padding="same")(h)))

    inp = keras.Input((frames, hw, hw, 3))
    h = block(inp, 16)
    h = L.MaxPooling3D(2)(L.Add()([h, L.Dropout(0.2)(block(h, 16))]))
    h = L.Concatenate()([h, block(h, 32)])
    model = keras.Model(inp, L.Dense(5)(L.GlobalAveragePooling3D()(h)), name="conv3d")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, frames, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def unet3d(batch=4, frames=16, hw=32):
    """A 3-D U-Net for video or volumes: Conv3D with BatchNorm, MaxPooling3D, Dropout at the
    bottleneck, 3x3x3 stride-2 Conv3DTranspose layers up, concatenated skips, a per-voxel
    loss."""
    import keras
    import tensorflow as tf

    L = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((frames, hw, hw, 3))
    h, skips = L.Conv3D(16, 3, padding="same")(inp), []
    for f in (16, 32):
        h = L.BatchNormalization()(L.Conv3D(f, 3, padding="same", activation="relu")(h))
        skips.append(h)
        h = L.MaxPooling3D(2)(h)
    h = L.Dropout(0.2)(h)
    for s in reversed(skips):
        f = int(s.shape[-1])
        h = L.Conv3DTranspose(f, 3, strides=2, padding="same")(h)
        h = L.Conv3D(f, 3, padding="same", activation="relu")(L.Concatenate()([h, s]))
    model = keras.Model(inp, L.Conv3D(1, 1)(h), name="unet3d")
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True), optimizer="adam")
    return model, tf.TensorSpec((batch, frames, hw, hw, 3)), \
        tf.TensorSpec((batch, frames, hw, hw, 1))


def gptmini(batch=16, steps=128, vocab=500, dim=64, heads=4, depth=3):
    """A causal language model: token and position Embeddings, pre-norm blocks of causal
    MultiHeadAttention (attention Dropout) and a GELU MLP with Dropout, residual adds,
    BatchNorm before the per-token head; a label per token."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((steps,), dtype="int32")
    pos = L.Embedding(steps, dim)(keras.ops.arange(steps)[None, :] * keras.ops.ones_like(inp))
    h = L.Add()([L.Embedding(vocab, dim)(inp), pos])
    for _ in range(depth):
        a = L.LayerNormalization()(h)
        a = L.MultiHeadAttention(heads, dim // heads, dropout=0.1)(a, a, use_causal_mask=True)
        h = L.Add()([h, L.Dropout(0.1)(a)])
        m = L.Dense(dim)(L.Dense(4 * dim, activation="gelu")(L.LayerNormalization()(h)))
        h = L.Add()([h, L.Dropout(0.1)(m)])
    model = keras.Model(inp, L.Dense(vocab)(L.BatchNormalization()(h)), name="gptmini")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch, steps),
                                                                           tf.int32)


def xception(batch=32, hw=64):
    """A small Xception: SeparableConv2D (depthwise then pointwise) with BatchNorm, strided
    MaxPooling2D beside 1x1 strided projection shortcuts, SpatialDropout2D, a top Dropout."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False)(inp)
    h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
    for width in (64, 128, 128):
        s = keras.layers.Conv2D(width, 1, strides=2, use_bias=False)(h)
        s = keras.layers.BatchNormalization()(s)
        r = keras.layers.Activation("relu")(h)
        r = keras.layers.SeparableConv2D(width, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("relu")(r)
        r = keras.layers.SpatialDropout2D(0.1)(r)
        r = keras.layers.SeparableConv2D(width, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.MaxPooling2D(3, strides=2, padding="same")(r)
        h = keras.layers.Add()([r, s])
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(10)(keras.layers.Dropout(0.3)(h))
    model = keras.Model(inp, out, name="xception")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.RMSprop(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def tcn(batch=32, steps=256, features=16):
    """A temporal convolutional network: dilated causal Conv1D (rates 1-8), LayerNorm,
    SpatialDropout1D, residual adds with a 1x1 projection, a per-step regression loss."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps, features))
    h = keras.layers.Conv1D(64, 1)(inp)
    for rate in (1, 2, 4, 8):
        r = keras.layers.Conv1D(64, 3, padding="causal", dilation_rate=rate)(h)
        r = keras.layers.LayerNormalization()(r)
        r = keras.layers.Activation("relu")(r)
        r = keras.layers.SpatialDropout1D(0.1)(r)
        r = keras.layers.Conv1D(64, 3, padding="causal", dilation_rate=rate)(r)
        r = keras.layers.LayerNormalization()(r)
        h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
    out = keras.layers.Conv1D(10, 1)(h)
    model = keras.Model(inp, out, name="tcn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, steps, features)), tf.TensorSpec((batch, steps),
                                                                        tf.int32)


def grouped(batch=16, hw=64):
    """Grouped 3x3 convolutions (groups=4) with BatchNorm in a ResNeXt-style block, average
    pooling down, UpSampling2D back up with a concatenated skip, Dropout, a per-pixel loss."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
    h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
    skip = h
    h = keras.layers.AveragePooling2D(2)(h)
    for _ in range(3):
        r = keras.layers.Conv2D(64, 1, use_bias=False)(h)
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
        r = keras.layers.Conv2D(64, 3, padding="same", groups=4, use_bias=False)(r)
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
        r = keras.layers.Conv2D(32, 1, use_bias=False)(keras.layers.Dropout(0.2)(r))
        h = keras.layers.Add()([h, keras.layers.BatchNormalization()(r)])
    h = keras.layers.UpSampling2D()(h)
    h = keras.layers.Concatenate()([h, skip])
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    out = keras.layers.Conv2D(4, 1)(h)
    model = keras.Model(inp, out, name="grouped")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, hw, hw), tf.int32)


def regnet(batch=32, hw=32):
    """Post-activation ResNet with L2 kernel regularizers (the loss adds ``model.losses``),
    SpatialDropout2D, strided 1x1 projections, ReLU6, GlobalMaxPooling, softmax outputs and SGD
    with Nesterov momentum."""
    import keras
    import tensorflow as tf

    reg = keras.regularizers.L2(1e-4)
    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, kernel_regularizer=reg)(inp)
    h = keras.layers.Activation("relu6")(keras.layers.BatchNormalization(momentum=0.9)(h))
    for width, stride in ((32, 1), (64, 2), (64, 1), (96, 2)):
        r = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False,
                                kernel_regularizer=reg)(h)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        r = keras.layers.SpatialDropout2D(0.1)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        s = h
        if stride != 1 or h.shape[-1] != width:
            s = keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(h)
            s = keras.layers.BatchNormalization()(s)
        h = keras.layers.ReLU()(keras.layers.Add()([r, s]))
    h = keras.layers.Dropout(0.3)(keras.layers.GlobalMaxPooling2D()(h))
    out = keras.layers.Dense(10, activation="softmax", kernel_regularizer=reg)(h)
    model = keras.Model(inp, out, name="regnet")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def resmlp(batch=1024, features=256, width=512, depth=4):
    """Pre-norm residual MLP: LayerNorm, GELU, Dropout inside each block, BatchNorm before the
    head, AdamW with weight decay."""
    import keras
    import tensorflow as tf

    inp = keras.Input((features,))
    h = keras.layers.Dense(width, activation="gelu")(inp)
    for _ in range(depth):
        r = keras.layers.LayerNormalization()(h)
        r = keras.layers.Dense(2 * width, activation="gelu")(r)
        r = keras.layers.Dropout(0.2)(r)
        h = keras.layers.Add()([h, keras.layers.Dense(width)(r)])
    out = keras.layers.Dense(10)(keras.layers.BatchNormalization()(h))
    model = keras.Model(inp, out, name="resmlp")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01))
    return model, tf.TensorSpec((batch, features)), tf.TensorSpec((batch,), tf.int32)


def _subclassed_class():
    """Defined on first use, so that importing this module needs no Keras."""
    import keras

    class ResSub(keras.Model):
        """Residual blocks made in ``__init__`` and wired in ``call``, Dropout only in a
        ``training`` branch, and no ``build`` method: nothing has variables until the model is
        called (``optimize`` calls it symbolically on the spec)."""

        def __init__(self, widths=(32, 32, 64, 64)):
            super().__init__(name="res_sub")
            self.stem = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False)
            self.stem_bn = keras.layers.BatchNormalization()
            self.blocks = []
            prev = widths[0]
            for w in widths:
                self.blocks.append(dict(
                    c1=keras.layers.Conv2D(w, 3, padding="same", use_bias=False),
                    b1=keras.layers.BatchNormalization(),
                    c2=keras.layers.Conv2D(w, 3, padding="same", use_bias=False),
                    b2=keras.layers.BatchNormalization(),
                    proj=keras.layers.Conv2D(w, 1) if w != prev else None))
                prev = w
            self.drop = keras.layers.Dropout(0.2)
            self.pool = keras.layers.GlobalAveragePooling2D()
            self.head = keras.layers.Dense(10)

        def call(self, x, training=False):
            h = keras.ops.relu(self.stem_bn(self.stem(x), training=training))
            for b in self.blocks:
                r = keras.ops.relu(b["b1"](b["c1"](h), training=training))
                r = b["b2"](b["c2"](r), training=training)
                s = h if b["proj"] is None else b["proj"](h)
                h = keras.ops.relu(r + s)
            h = self.pool(h)
            if training:
                h = self.drop(h, training=training)
            return self.head(h)

    return ResSub


def subclassed(batch=32, hw=32):
    """A subclassed residual CNN, never built before ``optimize``; Adam with a cosine learning
    rate schedule and global gradient-norm clipping."""
    import keras
    import tensorflow as tf

    model = _subclassed_class()()
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, 1000, warmup_target=2e-3,
                                                      warmup_steps=10)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(schedule, global_clipnorm=1.0),
                  metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def augment(batch=32, hw=32):
    """Augmentation inside the model (Normalization, RandomFlip, RandomRotation, RandomZoom,
    RandomContrast: random ops in the training step), a nested backbone model whose first
    block is frozen (its BatchNorm then runs in inference mode), an activity regularizer, and
    AdamW keeping an exponential moving average of the weights."""
    import keras
    import tensorflow as tf

    def block(h, width):
        r = keras.layers.Conv2D(width, 3, padding="same")(h)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        r = keras.layers.Dropout(0.1)(r)
        r = keras.layers.Conv2D(width, 3, padding="same")(r)
        s = h if h.shape[-1] == width else keras.layers.Conv2D(width, 1)(h)
        return keras.layers.Add()([s, r])

    bin_ = keras.Input((hw, hw, 3))
    frozen = block(bin_, 32)
    backbone = keras.Model(bin_, block(block(frozen, 32), 64), name="backbone")
    for layer in backbone.layers[:7]:
        layer.trainable = False
    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Normalization(mean=0.5, variance=0.25)(inp)
    for aug in (keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.1),
                keras.layers.RandomZoom(0.1), keras.layers.RandomContrast(0.2)):
        h = aug(h)
    h = block(backbone(h), 64)
    h = keras.layers.Conv2D(64, 3, padding="same",
                            activity_regularizer=keras.regularizers.L2(1e-5))(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="augment")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3, use_ema=True), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def _residual_cnn(name, optimizer, *, bn=None, head=None, batch=32, hw=32):
    """A pre-activation residual CNN (BatchNorm, Dropout, 1x1 projections) trained by
    ``optimizer(keras)``, its BatchNorm layers made by ``bn(keras)``, ``head`` applied before
    the pooling: one body under optimizers and layers the other models do not use (keras is
    imported when the model is built, not when this script loads)."""
    def build():
        import keras
        import tensorflow as tf

        def make_bn():
            return bn(keras) if bn else keras.layers.BatchNormalization()

        inp = keras.Input((hw, hw, 3))
        h = keras.layers.Conv2D(32, 3, padding="same")(inp)
        for width in (32, 64, 64):
            r = keras.layers.Activation("relu")(make_bn()(h))
            r = keras.layers.Conv2D(width, 3, padding="same")(r)
            r = keras.layers.Activation("relu")(make_bn()(r))
            r = keras.layers.Dropout(0.2)(r)
            r = keras.layers.Conv2D(width, 3, padding="same")(r)
            s = h if h.shape[-1] == width else keras.layers.Conv2D(width, 1)(h)
            h = keras.layers.Add()([s, r])
        if head is not None:
            h = head(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h), name=name)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=optimizer(keras))
        return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)

    build.__doc__ = f"residual CNN variant {name!r}"
    return build


def _nested_head(h):
    """A Sequential block inside the functional model (SpatialDropout2D, BatchNorm), bilinear
    upsampling, a strided convolution back and a concatenation."""
    import keras

    block = keras.Sequential([keras.layers.SpatialDropout2D(0.1),
                              keras.layers.Conv2D(64, 3, padding="same"),
                              keras.layers.BatchNormalization(), keras.layers.ReLU()],
                             name="block")
    u = keras.layers.UpSampling2D(2, interpolation="bilinear")(block(h))
    u = keras.layers.Conv2D(64, 3, strides=2, padding="same")(u)
    return keras.layers.Concatenate()([h, u])


def _attention_head(h):
    """Dot-product self-attention over the 32x32 positions (a 128 MiB score matrix at batch
    32), GaussianDropout, a residual LayerNormalization."""
    import keras

    s = keras.layers.Reshape((-1, h.shape[-1]))(h)
    a = keras.layers.GaussianDropout(0.1)(keras.layers.Attention()([s, s]))
    s = keras.layers.LayerNormalization()(keras.layers.Add()([s, a]))
    return keras.layers.Reshape(tuple(h.shape[1:]))(s)


def gru(batch=32, steps=64, features=32):
    """A causal Conv1D with BatchNorm, a GRU with input dropout, a residual LayerNorm."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps, features))
    h = keras.layers.BatchNormalization()(keras.layers.Conv1D(64, 5, padding="causal")(inp))
    r = keras.layers.GRU(64, return_sequences=True, dropout=0.1)(h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalMaxPooling1D()(keras.layers.Dropout(0.2)(h))
    model = keras.Model(inp, keras.layers.Dense(5)(h), name="gru")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, steps, features)), tf.TensorSpec((batch,), tf.int32)


def deep_rnn(batch=32, steps=64, features=32, vocab=1000):
    """Token ids through an Embedding, a Conv1D-BatchNorm stem, three stacked LSTMs with
    recurrent dropout, residual adds and LayerNorm between them, Dropout, a pooled head;
    AdamW and accuracy. Each loop keeps its time steps' gates for its gradient."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocab, features)(inp)
    h = keras.layers.BatchNormalization()(keras.layers.Conv1D(96, 3, padding="same")(h))
    h = keras.layers.Activation("relu")(h)
    for _ in range(3):
        r = keras.layers.LSTM(96, return_sequences=True, recurrent_dropout=0.1)(h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, keras.layers.Dropout(0.2)(r)]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, keras.layers.Dense(8)(h), name="deep_rnn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch,), tf.int32)


def timedist(batch=16, steps=8, hw=32):
    """A per-frame CNN under ``TimeDistributed`` (a static time axis: Keras slices the input
    once per frame, so each of its gradients is summed from eight input-sized terms), with
    BatchNorm, a residual add across frames, Dropout, and a frame-pooling head."""
    import keras
    import tensorflow as tf

    def td(layer):
        return keras.layers.TimeDistributed(layer)

    inp = keras.Input((steps, hw, hw, 3))
    h = td(keras.layers.Conv2D(24, 3, padding="same"))(inp)
    h = td(keras.layers.BatchNormalization())(h)
    r = td(keras.layers.Conv2D(24, 3, padding="same", activation="relu"))(h)
    r = keras.layers.Dropout(0.2)(td(keras.layers.BatchNormalization())(r))
    h = keras.layers.Add()([h, r])
    h = td(keras.layers.MaxPooling2D())(h)
    h = td(keras.layers.Conv2D(32, 3, padding="same", activation="relu"))(h)
    h = td(keras.layers.GlobalAveragePooling2D())(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(64, activation="relu")(h))
    model = keras.Model(inp, keras.layers.Dense(6)(keras.layers.Dropout(0.3)(h)),
                        name="timedist")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.RMSprop(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, steps, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


#: BatchNorm with renormalization under clipped SGD; Adafactor; Lion with a global clip;
#: Adam accumulating gradients over 2 steps; a nested Sequential with bilinear upsampling
#: under Nadam; self-attention under RMSprop
VARIANTS = {
    "renorm": _residual_cnn("renorm", lambda k: k.optimizers.SGD(0.01, momentum=0.9, clipnorm=1.0),
                            bn=lambda k: k.layers.BatchNormalization(renorm=True)),
    "adafactor": _residual_cnn("adafactor", lambda k: k.optimizers.Adafactor(1e-3)),
    "lion": _residual_cnn("lion", lambda k: k.optimizers.Lion(1e-4, global_clipnorm=1.0)),
    "accum": _residual_cnn("accum",
                           lambda k: k.optimizers.Adam(1e-3, gradient_accumulation_steps=2)),
    "nested": _residual_cnn("nested", lambda k: k.optimizers.Nadam(1e-3), head=_nested_head),
    "attn": _residual_cnn("attn", lambda k: k.optimizers.RMSprop(1e-3), head=_attention_head),
}


def _rdrop_class():
    import keras
    import tensorflow as tf

    class RDrop(keras.Model):
        """A train_step of its own: two dropout passes of the batch under one tape (R-Drop),
        their losses and the squared distance of their logits, gradients clipped by their
        global norm, a metric of its own."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.consistency = keras.metrics.Mean(name="consistency")
            self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

        def train_step(self, data):
            x, y = data[0], data[1]
            with tf.GradientTape() as tape:
                a = self(x, training=True)
                b = self(x, training=True)
                gap = tf.reduce_mean(tf.square(a - b))
                loss = 0.5 * (self.compute_loss(y=y, y_pred=a) +
                              self.compute_loss(y=y, y_pred=b)) + 0.5 * gap
            grads = tape.gradient(loss, self.trainable_variables)
            grads, _ = tf.clip_by_global_norm(grads, 5.0)
            self.optimizer.apply(grads, self.trainable_variables)
            self.consistency.update_state(gap)
            self.accuracy.update_state(y, a)
            return {"loss": loss, "consistency": self.consistency.result(),
                    "accuracy": self.accuracy.result()}

    return RDrop


def rdrop(batch=32, hw=32):
    """A residual CNN (BatchNorm, Dropout, strided projections) whose class overrides
    train_step (:func:`_rdrop_class`): what is planned is that step, two forward passes in it."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
    for width, stride in ((32, 1), (64, 2), (64, 1), (128, 2)):
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
        s = h if stride == 1 and h.shape[-1] == width else \
            keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(r)
        r = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(r)
        r = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(r))
        r = keras.layers.Dropout(0.2)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        h = keras.layers.Add()([r, s])
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.BatchNormalization()(h))
    out = keras.layers.Dense(10)(keras.layers.Dropout(0.3)(h))
    model = _rdrop_class()(inp, out, name="rdrop")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def masked(batch=32, steps=64, vocab=2000):
    """Token ids with padding (``mask_zero``): the mask reaches a Bidirectional LSTM, a masked
    residual LSTM and masked mean pooling, with Dropout and LayerNorm between them."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((steps,), dtype="int32")
    h = L.Embedding(vocab, 64, mask_zero=True)(inp)
    h = L.Bidirectional(L.LSTM(64, return_sequences=True))(h)
    r = L.LSTM(128, return_sequences=True)(L.Dropout(0.2)(h))
    h = L.LayerNormalization()(L.Add()([h, r]))
    h = L.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, L.Dense(4)(L.Dropout(0.3)(h)), name="masked")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch,), tf.int32)


def convlstm(batch=8, frames=6, hw=32):
    """ConvLSTM2D over short clips (a tf.while_loop of convolutions), BatchNorm, SpatialDropout,
    a residual Conv3D, and a ConvLSTM2D that returns its last state."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((frames, hw, hw, 3))
    h = L.ConvLSTM2D(32, 3, padding="same", return_sequences=True)(inp)
    h = L.BatchNormalization()(h)
    r = L.Conv3D(32, 3, padding="same", activation="relu")(L.SpatialDropout3D(0.1)(h))
    h = L.Add()([h, L.BatchNormalization()(r)])
    h = L.ConvLSTM2D(32, 3, padding="same")(h)
    h = L.GlobalAveragePooling2D()(L.BatchNormalization()(h))
    model = keras.Model(inp, L.Dense(10)(L.Dropout(0.3)(h)), name="convlstm")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-3))
    return model, tf.TensorSpec((batch, frames, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def specnorm(batch=32, hw=32):
    """A residual CNN whose convolutions are wrapped in SpectralNormalization (a power
    iteration that assigns a variable in the forward pass), with BatchNorm, Dropout,
    ActivityRegularization and kernel regularizers (losses the model adds to its own)."""
    import keras
    import tensorflow as tf

    L = keras.layers
    reg = keras.regularizers.L2(1e-4)
    inp = keras.Input((hw, hw, 3))
    h = L.SpectralNormalization(L.Conv2D(32, 3, padding="same"))(inp)
    for width, stride in ((32, 1), (64, 2), (64, 1)):
        r = L.SpectralNormalization(
            L.Conv2D(width, 3, strides=stride, padding="same", kernel_regularizer=reg))(h)
        r = L.Dropout(0.2)(L.Activation("relu")(L.BatchNormalization()(r)))
        r = L.Conv2D(width, 3, padding="same", kernel_regularizer=reg)(r)
        r = L.ActivityRegularization(l2=1e-5)(L.BatchNormalization()(r))
        s = h if stride == 1 and h.shape[-1] == width else L.Conv2D(width, 1, strides=stride)(h)
        h = L.Activation("relu")(L.Add()([r, s]))
    h = L.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, L.Dense(10)(L.Dropout(0.3)(h)), name="specnorm")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def onehot(batch=32, hw=32):
    """The way a tutorial writes it: string loss and optimizer (``"categorical_crossentropy"``
    on one-hot float labels, ``"adam"``), a softmax output, residual blocks with BatchNorm and
    Dropout, 1x1 projections."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    for f in (32, 64, 64):
        r = keras.layers.Conv2D(f, 3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("relu")(r)
        r = keras.layers.Dropout(0.1)(r)
        r = keras.layers.Conv2D(f, 3, padding="same")(r)
        r = keras.layers.BatchNormalization()(r)
        s = h if h.shape[-1] == f else keras.layers.Conv2D(f, 1)(h)
        h = keras.layers.Activation("relu")(keras.layers.add([s, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dropout(0.3)(h)
    out = keras.layers.Dense(10, activation="softmax")(h)
    model = keras.Model(inp, out)
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, 10))


def segment(batch=8, hw=64):
    """Per-pixel regression (``"mse"``, ``"sgd"``): a U-Net with Conv2DTranspose upsampling,
    concatenated skips, BatchNorm, SpatialDropout2D and Dropout, ELU."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    e1 = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    e1 = keras.layers.BatchNormalization()(e1)
    p1 = keras.layers.MaxPooling2D()(e1)
    e2 = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(p1)
    e2 = keras.layers.BatchNormalization()(e2)
    e2 = keras.layers.SpatialDropout2D(0.1)(e2)
    p2 = keras.layers.MaxPooling2D()(e2)
    b = keras.layers.Conv2D(64, 3, padding="same", activation="elu")(p2)
    b = keras.layers.Dropout(0.2)(b)
    u2 = keras.layers.Conv2DTranspose(32, 2, strides=2)(b)
    d2 = keras.layers.Concatenate()([u2, e2])
    d2 = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(d2)
    u1 = keras.layers.Conv2DTranspose(16, 2, strides=2)(d2)
    d1 = keras.layers.Concatenate()([u1, e1])
    d1 = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(d1)
    out = keras.layers.Conv2D(1, 1)(d1)
    model = keras.Model(inp, out)
    model.compile(loss="mse", optimizer="sgd")
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, hw, hw, 1))


def binary(batch=32, hw=32):
    """Binary classification (sigmoid, ``"binary_crossentropy"``, AUC metric, AdamW): Rescaling,
    ZeroPadding2D, LeakyReLU, depthwise-separable residual blocks with swish, BatchNorm and
    Dropout, AveragePooling2D, Flatten."""
    import keras
    import tensorflow as tf

    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Rescaling(1 / 255.0)(inp)
    h = keras.layers.ZeroPadding2D(1)(h)
    h = keras.layers.Conv2D(32, 3, strides=1)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.LeakyReLU(0.1)(h)
    for _ in range(3):
        r = keras.layers.DepthwiseConv2D(3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("swish")(r)
        r = keras.layers.Conv2D(32, 1)(r)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Dropout(0.1)(r)
        h = keras.layers.Add()([h, r])
    h = keras.layers.AveragePooling2D(2)(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.5)(h)
    out = keras.layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inp, out)
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.AdamW(1e-3),
                  metrics=["accuracy", keras.metrics.AUC()])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch, 1))


def mha(batch=32, steps=64, vocab=1000, dim=64):
    """Token ids through an Embedding, two post-norm blocks of MultiHeadAttention (attention
    dropout) and a GELU feed-forward, BatchNorm after the second residual add, max pooling;
    ``"rmsprop"``."""
    import keras
    import tensorflow as tf

    inp = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(inp)
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, dim // 4, dropout=0.1)(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
        f = keras.layers.Dense(4 * dim, activation="gelu")(h)
        f = keras.layers.Dropout(0.1)(keras.layers.Dense(dim)(f))
        h = keras.layers.BatchNormalization()(keras.layers.Add()([h, f]))
    h = keras.layers.GlobalMaxPooling1D()(h)
    out = keras.layers.Dense(5)(h)
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="rmsprop", metrics=["accuracy"])
    return model, tf.TensorSpec((batch, steps), tf.int32), tf.TensorSpec((batch,), tf.int32)


def constrained(batch=32, hw=32):
    """Weight constraints (MaxNorm, UnitNorm, NonNeg on a bias, MinMaxNorm: assigns after the
    update that read the updated weights), PReLU after each BatchNorm, Dropout, a Maximum
    merge with a Lambda, max pooling; SGD with momentum clipping each gradient's values,
    ``steps_per_execution=2``."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((hw, hw, 3))
    h = L.Conv2D(32, 3, padding="same", kernel_constraint=keras.constraints.MaxNorm(1.0))(inp)
    h = L.PReLU(shared_axes=[1, 2])(L.BatchNormalization()(h))
    for width in (32, 64):
        r = L.Conv2D(width, 3, padding="same",
                     kernel_constraint=keras.constraints.UnitNorm(axis=[0, 1, 2]))(h)
        r = L.Dropout(0.2)(L.PReLU(shared_axes=[1, 2])(L.BatchNormalization()(r)))
        r = L.Conv2D(width, 3, padding="same", bias_constraint=keras.constraints.NonNeg())(r)
        s = h if h.shape[-1] == width else L.Conv2D(width, 1)(h)
        h = L.MaxPooling2D()(L.Maximum()([s, L.Lambda(lambda t: 0.5 * t)(r)]))
    h = L.GlobalAveragePooling2D()(h)
    out = L.Dense(10, kernel_constraint=keras.constraints.MinMaxNorm(0.0, 2.0))(h)
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.5),
                  steps_per_execution=2, metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def _penalty_class():
    import keras

    class Penalty(keras.layers.Layer):
        """Scales its input by a weight of its own and adds a loss from the result with
        ``add_loss`` (as a VAE's KL term is added)."""

        def __init__(self, rate, **kwargs):
            super().__init__(**kwargs)
            self.rate = rate

        def build(self, shape):
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

        def call(self, x):
            y = x * self.scale
            self.add_loss(self.rate * keras.ops.mean(keras.ops.square(y)))
            return y

    return Penalty


def augpenalty(batch=32, hw=32):
    """RandomRotation, RandomZoom and RandomContrast inside the model, an encoder-decoder with a
    strided Conv2D, a Conv2DTranspose back and a skip add, a custom layer that ``add_loss``es,
    Dropout with a ``noise_shape``, GaussianNoise, GELU/LeakyReLU/ELU after BatchNorm; a
    summed (not averaged) loss under AdamW with AMSGrad."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((hw, hw, 3))
    a = L.RandomContrast(0.2)(L.RandomZoom(0.1)(L.RandomRotation(0.1)(inp)))
    h = L.Conv2D(32, 3, padding="same", use_bias=False)(a)
    skip = h = L.Activation("gelu")(L.BatchNormalization()(h))
    h = L.Conv2D(64, 3, strides=2, padding="same")(h)
    h = _penalty_class()(1e-3)(L.LeakyReLU(0.1)(L.BatchNormalization()(h)))
    h = L.Dropout(0.2, noise_shape=(None, 1, 1, 64))(h)
    h = L.Add()([L.Conv2DTranspose(32, 3, strides=2, padding="same")(h), skip])
    h = L.Activation("elu")(L.BatchNormalization()(h))
    h = L.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = L.GlobalMaxPooling2D()(L.GaussianNoise(0.05)(h))
    model = keras.Model(inp, L.Dense(10)(L.Dropout(0.3)(h)))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction="sum"),
                  optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01, amsgrad=True),
                  metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def convnext(batch=16, hw=64):
    """ConvNeXt-style blocks: a patchifying stem with BatchNorm, depthwise 7x7 convolutions,
    LayerNorm, a GELU MLP, a layer scale (a custom layer's weight) and stochastic depth as
    Dropout with a per-sample ``noise_shape``; AdamW."""
    import keras
    import tensorflow as tf

    L = keras.layers

    class LayerScale(L.Layer):
        def build(self, shape):
            self.gamma = self.add_weight(shape=(shape[-1],),
                                         initializer=keras.initializers.Constant(0.1))

        def call(self, x):
            return x * self.gamma

    inp = keras.Input((hw, hw, 3))
    h = L.BatchNormalization()(L.Conv2D(48, 4, strides=4)(inp))
    for stage, width in enumerate((48, 96, 192)):
        if stage:
            h = L.Conv2D(width, 2, strides=2)(L.LayerNormalization()(h))
        for _ in range(2):
            r = L.LayerNormalization(epsilon=1e-6)(L.DepthwiseConv2D(7, padding="same")(h))
            r = L.Dense(width)(L.Dense(4 * width, activation="gelu")(r))
            r = L.Dropout(0.1, noise_shape=(None, 1, 1, 1))(LayerScale()(r))
            h = L.Add()([h, r])
    h = L.Dropout(0.2)(L.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, L.Dense(10)(h))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3), metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def attention(batch=32, hw=32):
    """A CNN with BatchNorm whose strided features attend over themselves
    (``keras.layers.Attention``, scaled, with dropout), upsampled and concatenated with the
    full-resolution ones, padded and cropped, swish, SpatialDropout2D, a softmax head; Nadam."""
    import keras
    import tensorflow as tf

    L = keras.layers
    inp = keras.Input((hw, hw, 3))
    s = L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 3, padding="same", use_bias=False)(inp)))
    h = L.Activation("relu")(L.BatchNormalization()(
        L.Conv2D(64, 3, strides=2, padding="same")(s)))
    t = L.Reshape(((hw // 2) ** 2, 64))(h)
    a = L.Attention(use_scale=True, dropout=0.1)([L.Dense(64)(t), t])
    t = L.LayerNormalization()(L.Add()([t, a]))
    h = L.UpSampling2D()(L.Reshape((hw // 2, hw // 2, 64))(t))
    h = L.Cropping2D(1)(L.ZeroPadding2D(1)(L.Concatenate()([h, s])))
    h = L.Activation("swish")(L.BatchNormalization()(L.Conv2D(64, 3, padding="same")(h)))
    h = L.Dropout(0.3)(L.GlobalMaxPooling2D()(L.SpatialDropout2D(0.1)(h)))
    model = keras.Model(inp, L.Dense(10, activation="softmax")(h))
    model.compile(loss="sparse_categorical_crossentropy", optimizer="nadam",
                  metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def seqcnn(batch=32, hw=32):
    """A ``keras.Sequential`` CNN (no skips): Conv2D-BatchNorm-ReLU, MaxPooling, Dropout,
    Flatten, a softmax head under ``"sparse_categorical_crossentropy"`` and ``"adam"``."""
    import keras
    import tensorflow as tf

    model = keras.Sequential([
        keras.Input((hw, hw, 3)),
        keras.layers.Conv2D(32, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Dropout(0.25),
        keras.layers.Conv2D(64, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(), keras.layers.Dropout(0.25),
        keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.5), keras.layers.Dense(10, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam",
                  metrics=["accuracy"])
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def _application(factory, hw, batch, optimizer):
    """A ``keras.applications`` model (weights=None) at a CPU-sized input and batch: sizes
    where activations, not the weights and optimizer slots, make up most of the step (at 64
    pixels and batch 8, ResNet50V2, InceptionV3 and EfficientNetV2B0 cannot reach 60%)."""
    def build():
        import keras
        import tensorflow as tf

        model = getattr(keras.applications, factory)(
            weights=None, input_shape=(hw, hw, 3), classes=10, classifier_activation=None)
        opt = (keras.optimizers.SGD(0.01, momentum=0.9) if optimizer == "sgd"
               else keras.optimizers.AdamW(1e-3))
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=opt, metrics=["accuracy"])
        return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)

    build.__doc__ = f"keras.applications.{factory} at {hw}x{hw}, batch {batch}, {optimizer}"
    return build


#: inverted residuals with ReLU6; hard-swish and squeeze-excitation with a Rescaling input;
#: pre-activation residuals; fused MBConv with stochastic depth; Inception's concatenations
APPLICATIONS = {"mobilenetv2": _application("MobileNetV2", 64, 16, "sgd"),
                "mobilenetv3s": _application("MobileNetV3Small", 64, 16, "adamw"),
                "resnet50v2": _application("ResNet50V2", 96, 24, "sgd"),
                "efficientnetv2": _application("EfficientNetV2B0", 96, 24, "adamw"),
                "inceptionv3": _application("InceptionV3", 96, 24, "sgd")}

MODELS = {"resdrop": resdrop, "unet_bn": unet_bn, "densenet": densenet,
          "efficientnet": efficientnet, "mixer": mixer, "vit": vit,
          "twotower": twotower, "siamese": siamese, "decoder_gn": decoder_gn,
          "noisy": noisy, "bilstm": bilstm, "xception": xception, "tcn": tcn,
          "textcnn": textcnn, "senet": senet, "fpn": fpn, "conv3d": conv3d, "unet3d": unet3d,
          "gptmini": gptmini,
          "grouped": grouped, "regnet": regnet, "resmlp": resmlp,
          "subclassed": subclassed, "augment": augment, "mixed": mixed, "gru": gru,
          "timedist": timedist, "deep_rnn": deep_rnn, "rdrop": rdrop,
          "masked": masked, "convlstm": convlstm, "specnorm": specnorm,
          "onehot": onehot, "segment": segment, "binary": binary, "mha": mha,
          "seqcnn": seqcnn, "convnext": convnext, "attention": attention,
          "constrained": constrained, "augpenalty": augpenalty, "lstmconv": lstmconv,
          **VARIANTS, **APPLICATIONS}


# --------------------------------------------------------------------- one case
def _batch(spec) -> int:
    """The batch size of a spec or a nest of them (a multi-input model's)."""
    import tensorflow as tf

    return int(tf.nest.flatten(spec)[0].shape[0])


def _data(xs, ys, model, n=None, seed=0):
    """Synthetic inputs and labels for the specs (nests too): normal floats, integer inputs
    token ids; integer labels under the class count of the output they belong to (by output
    name), float labels normal."""
    import numpy as np
    import tensorflow as tf

    import keras

    rng = np.random.default_rng(seed)
    n = n or _batch(xs)
    # integer inputs are token ids, under the first Embedding's vocabulary
    vocab = next((la.input_dim for la in model._flatten_layers()
                  if isinstance(la, keras.layers.Embedding)), 2)

    def features(s):
        shape = (n,) + tuple(s.shape[1:])
        if s.dtype.is_integer:
            return rng.integers(0, vocab, shape).astype(s.dtype.as_numpy_dtype)
        return rng.standard_normal(shape).astype("float32")

    x = tf.nest.map_structure(features, xs)
    if hasattr(model, "outputs"):
        # (a Sequential has outputs but no output names)
        names = getattr(model, "output_names", None) or range(len(model.outputs))
        widths = {k: int(o.shape[-1]) for k, o in zip(names, model.outputs)}
        first = int(model.outputs[0].shape[-1])
    else:  # a subclassed model, perhaps not built yet: its last Dense layer's width
        widths = {}
        first = [la.units for la in model._flatten_layers() if hasattr(la, "units")][-1]

    def label(s, name=None):
        shape = (n,) + tuple(s.shape[1:])
        if not s.dtype.is_integer:
            return rng.standard_normal(shape).astype(s.dtype.as_numpy_dtype)
        return rng.integers(0, widths.get(name, first), shape).astype(s.dtype.as_numpy_dtype)

    if isinstance(ys, dict):  # labels by output name
        return x, {k: label(s, k) for k, s in ys.items()}
    return x, tf.nest.map_structure(label, ys)


def _rounding_spread(run, variables, x, y, model) -> float:
    """How far the plain step's gradients move when the float inputs and trainable weights move
    by at most one rounding step of the precision the model computes in (each times 1 + eps/2
    with a random sign, which rounds to one unit in the last place down or no change): the
    scale of rounding in this model's gradients, against which ``grad err`` reads. (Before
    2026-12-06 the inputs alone at float32's step: 0 for models whose inputs are token ids or
    are cast to bfloat16.) A rewritten step sums in other orders
    wherever Grappler rewrites its copies otherwise than the plain step's ops, and a ReLU or
    BatchNorm can turn those last bits into gradients 1e-4 apart (``grouped``); an error far
    above this figure would be a wrong value, not rounding."""
    import numpy as np

    # (the model's weights too: one the step does not capture is nudged and put back as well)
    variables = list({id(v): v for v in list(variables) + model.trainable_variables}.values())
    saved = [np.array(v.numpy(), copy=True) for v in variables]

    def grads(inputs):
        try:  # the seed generators advance each call: the same dropout masks for both
            return run(inputs, y)
        finally:
            for v, s in zip(variables, saved):
                v.assign(s)

    g1 = grads(x)
    eps = _compute_eps(model)
    _nudge_weights(model, eps)  # (grads restores them)
    g2 = grads(_nudged(x, eps))
    scale = max(float(np.abs(g).max()) for g in g1)
    return max(float(np.abs(a - b).max()) for a, b in zip(g1, g2)) / scale


def _nudged(x, eps=None):
    """The inputs with each float value times 1 + eps/2 with a random sign (fixed seed; eps:
    the value's own dtype's unless given)."""
    import numpy as np
    import tensorflow as tf

    def nudge(t):
        if not t.dtype.is_floating:
            return t
        e = np.finfo(t.dtype.as_numpy_dtype).eps if eps is None else eps
        sign = tf.sign(tf.random.stateless_normal(t.shape, [7, 11], dtype=t.dtype))
        return t * (1 + sign * e / 2)

    return tf.nest.map_structure(nudge, x)


def _compute_eps(model) -> float:
    """One unit in the last place at 1.0 in the precision the model computes in (a
    mixed-precision policy's float16 or bfloat16 makes a float32 nudge vanish in its casts)."""
    import numpy as np

    # the coarsest any layer computes in (a policy set per layer, too)
    table = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
    names = {getattr(getattr(la, "dtype_policy", None), "compute_dtype", None)
             for la in model._flatten_layers()}
    return max([table[n] for n in names if n in table], default=float(np.finfo("float32").eps))


def _nudge_weights(model, eps) -> dict:
    """Each trainable weight times 1 + eps/2 with a random sign; returns id -> the change.
    With integer inputs (token ids), which no nudge moves, this is what the rounding column
    of the whole step moves (a step whose only float input is its batch's ids read 0)."""
    import numpy as np

    rng = np.random.default_rng(13)
    moved = {}
    for v in model.trainable_variables:
        a = v.numpy()
        if not np.issubdtype(a.dtype, np.floating):
            continue
        b = (a * (1 + np.sign(rng.standard_normal(a.shape)) * eps / 2)).astype(a.dtype)
        v.assign(b)
        moved[id(v)] = b - a
    return moved


def _tracked(model) -> list:
    """Every variable a training step can change: the model's (seed generators' states
    included), its optimizer's and its metrics'."""
    found = list(model.variables) + list(model.optimizer.variables)
    found += list(getattr(model, "metrics_variables", []))
    return list({id(v): v for v in found}.values())


def _state_err(before, plain, other, names):
    """The worst variable's max |plain - other| over how far the plain step moved it, and its
    name. An integer variable (iterations, seed states) is 0 or 1: equal or not; a variable the
    plain step left alone and the other changed is 1."""
    import numpy as np

    worst, where = 0.0, None
    for name, b, p, o in zip(names, before, plain, other):
        if p.size == 0:
            continue
        if not np.issubdtype(p.dtype, np.floating):
            err = float(not np.array_equal(p, o))
        else:
            diff = float(np.abs(p.astype(np.float64) - o).max())
            move = float(np.abs(p.astype(np.float64) - b).max())
            err = 0.0 if diff == 0 else (diff / move if move else 1.0)
        if err > worst:
            worst, where = err, name
    return worst, where


def _fragmented(step, x, y, big, seed=0):
    """The step's measured peak beside a dozen held tensors of odd sizes, every other freed.

    Random sizes, not ``verification_layouts``' fixed ones: the point is a history that
    ``optimize`` did not verify in."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    held = [tf.fill([max(1, int(f * big) // 4)], 1.0) for f in rng.uniform(0.05, 0.5, 12)]
    held = held[::2]
    try:
        return step.measure(x, y, runs=2)["step_peak_bytes"]
    finally:
        del held


def run_case(name, fractions, time_limit, plans=None, weighted=False):
    import numpy as np
    import tensorflow as tf

    import tf_remat
    from tf_remat.api import measure_step_peak
    from tf_remat.errors import InfeasibleBudgetError
    from tf_remat.extract import overrides_train_step, trace_training_step

    import keras

    keras.utils.set_random_seed(1)
    model, xs, ys = _build(name)
    # a model's own train_step is what optimize plans and fit runs: the plain step is it, and
    # its update (it takes and applies its gradients inside) is compared in place of gradients
    own = overrides_train_step(model) is not None
    ref = trace_training_step(model, xs, ys, conv_gradients="tensorflow", train_step=own)
    xa, ya = _data(xs, ys, model)
    x, y = tf.nest.map_structure(tf.constant, (xa, ya))
    # --weighted: the step solved with per-sample weights, checked against Keras's weighted
    # step (the plain peak, and so the budget, stays the unweighted step's)
    wspec = tf.TensorSpec((_batch(xs),)) if weighted else None
    w = tf.constant(np.linspace(0.2, 2.0, _batch(xs)), tf.float32) if weighted else None
    gref = None if own else trace_training_step(
        model, xs, (ys, wspec) if weighted else ys, apply_updates=False,
        conv_gradients="tensorflow", weighted=weighted)
    wref = trace_training_step(model, xs, (ys, wspec), conv_gradients="tensorflow",
                               weighted=True, train_step=own) if weighted else ref
    yw = (y, w) if weighted else y
    base_runs = [measure_step_peak(ref.function, x, y, variables=ref.variables)
                 for _ in range(3)]
    base = int(statistics.median(r["step_peak_bytes"] for r in base_runs))
    out = {"model": name, "batch": _batch(xs), "params": int(model.count_params()),
           "baseline_peak": base, "baseline_peaks": [r["step_peak_bytes"] for r in base_runs],
           "rows": []}
    if own:
        def run(inputs, labels):
            # what one step of the model's own train_step changes
            w0 = [v.numpy() for v in model.trainable_variables]
            wref.function(inputs, labels)
            return [v.numpy() - a for v, a in zip(model.trainable_variables, w0)]
        out["rounding"] = _rounding_spread(run, wref.variables, x, yw, model)
    else:
        out["rounding"] = _rounding_spread(
            lambda inputs, labels: [t.numpy() for t in gref.function(inputs, labels)[1:]],
            gref.variables, x, yw, model)
    start = [np.array(v.numpy(), copy=True) for v in model.variables]
    for frac in fractions:
        budget = int(frac * base)
        for v, s in zip(model.variables, start):
            v.assign(s)
        row = {"fraction": frac, "budget": budget}
        t0 = time.perf_counter()
        try:
            step = tf_remat.optimize(model, budget_bytes=budget, input_spec=xs, label_spec=ys,
                                     time_limit=time_limit, verbose=0,
                                     sample_weight_spec=wspec)
        except InfeasibleBudgetError as exc:
            row.update(status="infeasible", min_feasible=exc.min_feasible,
                       seconds=time.perf_counter() - t0)
            out["rows"].append(row)
            continue
        rep = step.report
        row.update(status=rep["status"], strategy=rep["strategy"],
                   seconds=time.perf_counter() - t0, simulated=rep["predicted_peak_bytes"],
                   verified=rep["measured_peak_bytes"], attempts=rep["attempts"],
                   recomputed=rep["recomputed_nodes"], nodes=rep["nodes"])
        big = max(step.graph.memory)
        row["fresh"] = max(step.measure(x, y)["step_peak_bytes"] for _ in range(3))
        # gradients and BatchNorm statistics against the plain step, same state and batch
        tracked = _tracked(model)
        variables = list({id(v): v for v in tracked + list(ref.variables) +
                          list(gref.variables if gref is not None else []) +
                          list(wref.variables) +
                          list(step.rewritten.traced.variables)}.values())
        snap = [np.array(v.numpy(), copy=True) for v in variables]

        def restore():
            for v, s in zip(variables, snap):
                v.assign(s)

        if own:
            # the updates: each trainable variable's change in one step of each
            w0 = [v.numpy() for v in model.trainable_variables]
            wref.function(x, yw)
            g1 = [v.numpy() - a for v, a in zip(model.trainable_variables, w0)]
            restore()
            step(x, y, sample_weight=w)
            g2 = [v.numpy() - a for v, a in zip(model.trainable_variables, w0)]
        else:
            g1 = [t.numpy() for t in gref.function(x, yw)[1:]]
            restore()
            g2 = [t.numpy() for t in step.gradients(x, y, sample_weight=w)]
        restore()
        scale = max(float(np.abs(g).max()) for g in g1)
        row["grad_err"] = max(float(np.abs(a - b).max()) for a, b in zip(g1, g2)) / scale
        if plans:  # to replay a row later: both plans and graphs (the step's, the gradients')
            _save_plans(step, plans, f"{name}_{round(100 * frac)}", _batch(xs))
        s0 = [v.numpy() for v in model.non_trainable_variables if "moving" in v.path]
        wref.function(x, yw)
        s1 = [v.numpy() for v in model.non_trainable_variables if "moving" in v.path]
        restore()
        step(x, y, sample_weight=w)
        s2 = [v.numpy() for v in model.non_trainable_variables if "moving" in v.path]
        restore()
        # each statistic's difference over how far the plain step moved it: an update the
        # step skips is 1.0 however small the statistic (over the largest statistic, as
        # before, a BiLSTM model's skipped updates of 1e-5-sized moving means read 8.3e-5)
        row["bn_err"] = (max(float(np.abs(b - c).max()) / max(float(np.abs(b - a).max()), 1e-30)
                             for a, b, c in zip(s0, s1, s2)) if s1 else None)
        # everything one step changes, each variable over its own move: weights, optimizer
        # slots and iterations, BatchNorm statistics, seed generators, metrics; against the
        # same measure for the plain step with its float inputs and trainable weights moved
        # by a rounding step of the precision it computes in
        before = [np.array(v.numpy(), copy=True) for v in tracked]
        after = []
        for fn, args, kwargs in ((wref.function, (x, yw), {}),
                                 (step, (x, y), {"sample_weight": w})):
            fn(*args, **kwargs)
            after.append([np.array(v.numpy(), copy=True) for v in tracked])
            restore()
        eps = _compute_eps(model)
        moved = _nudge_weights(model, eps)
        wref.function(_nudged(x, eps), yw)
        # what the step changed from where it started, put back on the unmoved start
        after.append([np.array(v.numpy(), copy=True) - moved.get(id(v), 0) for v in tracked])
        restore()
        names = [getattr(v, "path", None) or v.name for v in tracked]
        row["state_err"], row["state_var"] = _state_err(before, after[0], after[1], names)
        row["state_rounding"], _ = _state_err(before, after[0], after[2], names)
        xt, yt = _data(xs, ys, model, n=3 * _batch(xs), seed=5)
        classes = int(np.max(tf.nest.flatten(yt)[0])) + 1
        hist = model.fit(xt, yt, batch_size=_batch(xs), epochs=2, verbose=0, shuffle=False,
                         class_weight={c: 0.5 + c / classes for c in range(classes)}
                         if weighted and np.ndim(yt) == 1 else None)
        row["fit_loss_finite"] = bool(np.all(np.isfinite(hist.history["loss"])))
        row["after_fit"] = step.measure(x, y, runs=2)["step_peak_bytes"]
        row["fragmented"] = _fragmented(step, x, y, big)
        step.detach()
        del step
        out["rows"].append(row)
        print(f"[{name}] {json.dumps(row)}", file=sys.stderr, flush=True)
    return out


def _save_plans(step, folder, stem, batch):
    os.makedirs(folder, exist_ok=True)
    for kind, built in (("step", step._primary()),
                        ("gradients", step._get(batch, apply_updates=False))):
        built.extraction.graph.save(os.path.join(folder, f"{stem}_{kind}.graph.json"))
        built.plan.save(os.path.join(folder, f"{stem}_{kind}.plan.json"))


def first_call_case(name, frac, time_limit):
    """A new model in a process where Keras's own step already ran; the rewritten step's first
    call after ``optimize`` is measured (no warm-up run)."""
    import tensorflow as tf

    import tf_remat
    from tf_remat.api import measure_step_peak
    from tf_remat.extract import overrides_train_step, trace_training_step

    import keras

    keras.utils.set_random_seed(1)
    model, xs, ys = _build(name)
    xa, ya = _data(xs, ys, model)
    model.train_on_batch(xa, ya)
    ref = trace_training_step(model, xs, ys, conv_gradients="tensorflow",
                              train_step=overrides_train_step(model) is not None)
    x, y = tf.nest.map_structure(tf.constant, (xa, ya))
    base = int(statistics.median(
        measure_step_peak(ref.function, x, y, variables=ref.variables)["step_peak_bytes"]
        for _ in range(3)))
    budget = int(frac * base)
    try:
        step = tf_remat.optimize(model, budget_bytes=budget, input_spec=xs, label_spec=ys,
                                 time_limit=time_limit, verbose=0)
    except tf_remat.InfeasibleBudgetError as err:
        # a refusal is this history's answer, as in run_case: a row, not a traceback
        return {"model": name, "fraction": frac, "budget": budget, "baseline_peak": base,
                "refused": int(err.min_feasible) if err.min_feasible else None}
    m = measure_step_peak(step.rewritten, x, y, variables=step.rewritten.traced.variables,
                          warmup=0)
    return {"model": name, "fraction": frac, "budget": budget, "baseline_peak": base,
            "first_call": m["step_peak_bytes"]}


# --------------------------------------------------------------------- report
HISTORIES = ("verified", "fresh", "after_fit", "fragmented")


def table(results, firsts) -> str:
    lines = ["| model | batch | plain peak MiB | budget | budget MiB | status | strategy | "
             "simulated MiB | verified | fresh | after fit | fragmented | first call | "
             "worst/budget | grad err | rounding | BN stats err | state err | state rounding | "
             "fit | solve+verify s |",
             "|" + "---|" * 21]
    first = {(f["model"], f["fraction"]): f for f in firsts if "first_call" in f}
    refused = {(f["model"], f["fraction"]) for f in firsts if "refused" in f}
    for res in results:
        if "error" in res:
            lines.append(f"| {res['model']} | | error: {res['error'][:120]} |" + " |" * 18)
            continue
        for r in res["rows"]:
            head = (f"| {res['model']} | {res['batch']} | {res['baseline_peak'] / MIB:.0f} | "
                    f"{100 * r['fraction']:.0f}% | {r['budget'] / MIB:.0f} |")
            if r["status"] == "infeasible":
                lines.append(f"{head} infeasible (smallest reachable "
                             f"{r['min_feasible'] / MIB:.0f} MiB) |" + " |" * 15)
                continue
            b = r["budget"]
            cols = [r[h] / b for h in HISTORIES]
            f = first.get((res["model"], r["fraction"]))
            if f is not None:
                cols.append(f["first_call"] / f["budget"])
            worst = max(cols)
            flag = "" if worst <= 1.0 else (" (slack)" if worst <= 1.05 else " **over**")
            cells = " | ".join(f"{c:.2f}" for c in cols[:4])
            fc = (f"{cols[4]:.2f}" if f is not None else
                  "refused" if (res["model"], r["fraction"]) in refused else "n/a")
            bn = "n/a" if r["bn_err"] is None else f"{r['bn_err']:.1e}"
            rnd = f"{res['rounding']:.1e}" if "rounding" in res else "n/a"
            # (rows saved before the state columns have none)
            st = "n/a" if r.get("state_err") is None else f"{r['state_err']:.1e}"
            if r.get("state_err") is not None and r["state_err"] > 1e-2:
                st += f" ({r['state_var']})"  # named where it is more than reassociation
            srnd = "n/a" if r.get("state_rounding") is None else f"{r['state_rounding']:.1e}"
            lines.append(
                f"{head} {r['status']} | {r['strategy']} | {r['simulated'] / MIB:.0f} | "
                f"{cells} | {fc} | {worst:.2f}{flag} | {r['grad_err']:.1e} | {rnd} | {bn} | "
                f"{st} | {srnd} | "
                f"{'ok' if r['fit_loss_finite'] else 'NaN'} | {r['seconds']:.0f} |")
    return "\n".join(lines)


NOTES = """\
## How to read this

* **plain peak**: the plain training step's measured peak (median of 3 runs): allocator peak
  during the step minus what was allocated before, plus the variables and the batch. The budget
  is 60% or 70% of it, as the held-out check takes it.
* The next five columns are the rewritten step's measured peak over the budget, each in another
  allocation history: **verified** is what `optimize` measured (the worst of its allocator layouts,
  `tf_remat.api.verification_layouts`; it accepts a plan at 95% or less, or the lowest within
  the budget when none gets there), **fresh** the worst of 3 `step.measure` calls right after,
  **after fit** after `model.fit` trained 2 epochs with the step, **fragmented** beside a dozen
  held tensors of odd sizes, **first call** the step's first call after `optimize` in another
  process where Keras's own `train_on_batch` ran first (its own plain peak and budget).
  **worst/budget** is the largest; "(slack)" marks 1.00-1.05, within the check's 5% slack.
* **grad err**: max |g_rewritten - g_plain| over all gradients over the largest gradient value
  (for a model whose class overrides `train_step`, `rdrop`, which `optimize` plans whole:
  the change of every trainable variable in one step of each, over the largest change);
  **BN stats err**: max |difference| of the BatchNorm moving statistics after one step of
  each, per statistic over how far the plain step moved it (1.0: an update skipped;
  float32 reassociation: up to ~1e-3, where one unit in the last place of a moving variance
  near 1 is a sizable share of a small move; before 2026-12-06 over the largest statistic,
  which a skipped update of a small moving mean passed at 8.3e-5).
  **state err**: everything one step of each changes (trainable weights, optimizer slots and
  iteration count, BatchNorm statistics, seed generators' states, metrics), the worst
  variable's max |difference| over how far the plain step moved it, named when over 1e-2;
  an integer variable (iterations, seeds) counts 1 unless equal, so 1.0 there is a skipped or
  doubled update; **state rounding** is the same measure for the plain step with its float
  inputs and trainable weights moved by half a unit in the last place of the precision the
  model computes in (bfloat16 for `mixed`; a weight's own move taken out before the
  comparison): with token ids for inputs, or a float32 nudge cast away to bfloat16, a nudge of
  the inputs alone moved nothing and read 0. An optimizer that divides by a gradient's size (Adam)
  turns rounding in gradients near zero into whole-size differences in their updates, so a
  state err near the state rounding is rounding, not a wrong update.
  **rounding**: how far the plain step's gradients move (same measure as grad err) when every
  float input value and trainable weight moves by at most one rounding step of the precision
  the model computes in (about half of them by one unit in the last place; before 2026-12-06
  the inputs alone at float32's, which read 0 for token-id inputs and `mixed`'s bfloat16): the
  size of rounding in this model's
  gradients (`rdrop`: in its update), which a step that sums in another order can reach. **fit**:
  `model.fit` with the rewritten step gave finite losses.
"""


#: --batch: the batch size every builder is called with (None: each builder's own)
BATCH = None


def _build(name):
    import inspect

    if not BATCH:
        return MODELS[name]()
    if "batch" not in inspect.signature(MODELS[name]).parameters:
        raise SystemExit(f"--batch: the {name} builder takes no batch size")
    return MODELS[name](batch=BATCH)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--no-first-call", action="store_true",
                   help="skip the first-call runs (one more process per model)")
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                          "heldout.md"))
    p.add_argument("--plans", default=None, metavar="DIR",
                   help="save each row's plans and graphs (the step's and the gradients') here")
    p.add_argument("--weighted", action="store_true",
                   help="solve the step with per-sample weights (optimize's "
                        "sample_weight_spec), compare it with Keras's weighted step and fit "
                        "with class_weight")
    p.add_argument("--batch", type=int, default=None,
                   help="the batch size for every model (default: each model's own)")
    p.add_argument("--reserve-mib", type=float, default=0,
                   help="tf_remat.reserve_memory of this much at each child process's start "
                        "(one large allocator region: README, allocator.md); 0: none")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)   # child process
    p.add_argument("--first", default=None, help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    global BATCH
    BATCH = args.batch
    if args.reserve_mib and (args.case or args.first):
        import tf_remat

        # before the child builds anything, as a user's program would call it
        tf_remat.reserve_memory(budget_bytes=int(args.reserve_mib * 2**20))
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, fractions, args.time_limit,
                                              args.plans, args.weighted)),
              flush=True)
        return 0
    if args.first:
        name, frac = json.loads(args.first)
        print("RESULT " + json.dumps(first_call_case(name, frac, args.time_limit)), flush=True)
        return 0

    def child(flag, value, label):
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), flag, value,
               "--fractions", args.fractions, "--time-limit", str(args.time_limit)]
        if args.plans:
            cmd += ["--plans", os.path.abspath(args.plans)]
        if args.weighted:
            cmd += ["--weighted"]
        if args.batch:
            cmd += ["--batch", str(args.batch)]
        if args.reserve_mib:
            cmd += ["--reserve-mib", str(args.reserve_mib)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        res = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")), None)
        if res is None:
            res = {"model": label, "error": f"exit code {proc.returncode}"}
        print(f"{label}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
        return res

    results, firsts = [], []
    for name in args.models:
        results.append(child("--case", name, name))
        if not args.no_first_call:
            firsts.append(child("--first", json.dumps([name, min(fractions)]),
                                f"{name} (first call)"))
    import tensorflow as tf

    from tf_remat.extract import onednn_enabled

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"oneDNN {'on' if onednn_enabled() else 'off'}; "
               f"Python {platform.python_version()}, TensorFlow {tf.__version__}")
    text = table(results, firsts)
    doc = ["# Held-out-style models through `tf_remat.optimize`", "",
           f"Machine: {machine}. `optimize` defaults (`auto`, profiled costs), time limit "
           f"{args.time_limit:g} s. Generated by `tools/bench_heldout.py`"
           + (" --weighted: the step weighs each sample (`sample_weight_spec`), gradients and "
              "BatchNorm statistics are against Keras's weighted step, `fit` gets "
              "`class_weight`" if args.weighted else "")
           + (f"; each child process called `tf_remat.reserve_memory` of {args.reserve_mib:g} "
              f"MiB first" if args.reserve_mib else "") + ".", "", text, "",
           NOTES]
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(doc))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
