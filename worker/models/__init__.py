"""The worker's models: which are loaded (the registry), each loaded model, LoRAs, memory, weights."""
