"""Images in: decoded, bounded image inputs (inputs.py) shared by the HTTP layer that
receives them and the engine and models that encode them."""
