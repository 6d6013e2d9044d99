"""A module's parameters from one flat vector θ (in ``named_parameters()`` order), and the
Hessian of a loss of θ by double backward: the autograd references of the tests."""
import math

import torch


def unflat(theta, names, shapes):
    """{name: the piece of θ shaped like that parameter} (views of θ, so autograd sees θ)."""
    out, o = {}, 0
    for n, s in zip(names, shapes):
        k = math.prod(s)
        out[n] = theta[o:o + k].reshape(s)
        o += k
    return out


def hessian_rows(loss, theta, rows):
    """Rows ``rows`` of ∇²loss(θ) (loss a function of θ), one double backward each."""
    th = theta.detach().clone().requires_grad_(True)
    g = torch.autograd.grad(loss(th), th, create_graph=True)[0]
    return torch.stack([torch.autograd.grad(g[i], th, retain_graph=True)[0] for i in rows])


def double_backward_hvp(loss, theta, v):
    """∇²loss(θ) v by double backward."""
    th = theta.detach().clone().requires_grad_(True)
    g = torch.autograd.grad(loss(th), th, create_graph=True)[0]
    return torch.autograd.grad(g @ v, th)[0]
