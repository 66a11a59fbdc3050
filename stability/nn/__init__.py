"""Lipschitz building blocks and the spectral / softmax maths the stabilizers share."""
