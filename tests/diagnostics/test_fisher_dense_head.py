"""The Fisher diagnostic's "projection" block of a model with a Dense head is the head (issue 55, item 4).

A sentence-transformers folder laid out Transformer -> Pooling -> Dense (LaBSE, distiluse) makes its
embedding with the Dense module; the diagnostic took the last Linear inside the transformer instead.
The folder is built and read back by sentence-transformers itself: the block is its Dense weights.
"""

import pytest
import torch
from builders import make_tiny_bert

from magclip.diagnostics.fisher import projection_names, text_fisher
from magclip.models.text import BiEncoder

st = pytest.importorskip("sentence_transformers")
try:
    from sentence_transformers.sentence_transformer import modules as stm
except ImportError:  # sentence-transformers 5
    from sentence_transformers import models as stm


def test_the_projection_block_is_the_dense_head(tmp_path):
    bert = make_tiny_bert(tmp_path / "bert")
    torch.manual_seed(0)
    modules = [stm.Transformer(str(bert), max_seq_length=32), stm.Pooling(32, "mean"),
               stm.Dense(32, 16, activation_function=torch.nn.Tanh()), stm.Normalize()]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "dense"))
    peer_dense = st.SentenceTransformer(str(tmp_path / "dense"), device="cpu")[2].linear

    model = BiEncoder.from_pretrained(tmp_path / "dense")
    names = projection_names(model)
    assert names == ["query_head.0.linear.weight", "query_head.0.linear.bias"]
    params = dict(model.named_parameters())
    assert torch.equal(params[names[0]], peer_dense.weight) and torch.equal(params[names[1]], peer_dense.bias)
    plain = BiEncoder.from_pretrained(bert)         # no head: the transformer's last Linear, as before
    assert projection_names(plain) == ["query_model.encoder.layer.1.output.dense.weight",
                                       "query_model.encoder.layer.1.output.dense.bias"]

    out = text_fisher(model, ["the cat sat", "a dog", "protein cell"], ["cat mat", "dog park", "cell study"],
                      modes=["cosine"])
    assert out["setup"]["block"]["parameters"] == names and out["setup"]["block"]["n_params"] == 16 * 32 + 16
