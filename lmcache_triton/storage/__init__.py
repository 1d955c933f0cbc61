"""Where chunks live once they leave the GPU: the tiers and the StorageManager over them."""
