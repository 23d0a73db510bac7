"""The embedded demo (`memra-dist demo`): its corpus, its tiny target / draft / DFlash /
EAGLE-3 / MTP checkpoints and their training on CPU, cached once per machine. The models
themselves live in memra_dist/model/; nothing here runs on a user's checkpoint."""
