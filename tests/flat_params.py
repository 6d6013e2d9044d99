"""A module's parameters from one flat vector θ (in ``named_parameters()`` order), for the
autograd references of the tests."""
import math


def unflat(theta, names, shapes):
    """{name: the piece of θ shaped like that parameter} (views of θ, so autograd sees θ)."""
    out, o = {}, 0
    for n, s in zip(names, shapes):
        k = math.prod(s)
        out[n] = theta[o:o + k].reshape(s)
        o += k
    return out
