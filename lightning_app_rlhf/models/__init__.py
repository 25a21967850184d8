"""The models of the roles: specs, building, tokenizers, precision, and the forward calls on them."""
