"""Model code: the Llama family and the layers it is built from."""
