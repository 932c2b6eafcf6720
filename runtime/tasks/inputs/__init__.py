"""Raw inputs into tensors: tokenized text, preprocessed images, log-mel audio features."""
