"""The ground floor: the facts every floor above reads (errors, the settings record, token ids, image digests, the
pool's slot arithmetic, the model's family, memory sizes, the stats records, the views)."""
