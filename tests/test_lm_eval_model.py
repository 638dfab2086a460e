import torch

from kvquant import get_method
from kvquant.eval.engine import Engine
from kvquant.eval.lm_eval_model import KVMethodLM


class Counting:
    """Wraps a method and counts the caches handed out."""

    def __init__(self, method):
        self.method, self.name, self.made = method, method.name, 0

    def new_cache(self, model):
        self.made += 1
        return self.method.new_cache(model)


def test_model_call_feeds_chunks_through_a_fresh_cache_and_generate_gets_one(stories):
    model, tok = stories
    method = Counting(get_method("truncation", keep_bits=9))
    lm = KVMethodLM(Engine(model, tok, method, chunk_size=8))
    ids = torch.tensor([tok("Once upon a time there was a cat").input_ids])
    logits = lm._model_call(ids)
    with torch.no_grad():
        plain = model(ids).logits
    assert method.made == 1 and logits.shape == plain.shape
    fp16 = KVMethodLM(Engine(model, tok, get_method("fp16"), chunk_size=8))
    fp16_err = (fp16._model_call(ids) - plain).abs().max()
    lossy_err = (logits - plain).abs().max()
    assert fp16_err < 0.05 and lossy_err > 5 * fp16_err  # the 9-bit cache was read, not a plain forward
    out = lm._model_generate(ids, max_length=ids.shape[1] + 5, stop=[], do_sample=False)
    assert method.made == 2 and out.shape[1] == ids.shape[1] + 5
    assert lm.max_length == 512 and lm.batch_size == 1
