"""Model execution: batch tensors, the forward pass, and token sampling."""
