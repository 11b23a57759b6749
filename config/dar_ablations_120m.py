# DAR's ablations at the 120m size proxy, paired as in config/rd_120m.py (5 seeds, 2.0B tokens,
# 2^19 tokens/step). The first arm, the reference of the report, is DAR per sublayer (the form the
# abstract presents as the method); against it: DAR in blocks of 4, DAR addressing each stream by
# its own keys (the reciprocal keys removed, the rest equal), Block AttnRes (one stream), and the
# two-stream designs the abstract positions itself against, HC and mHC with 2 streams.
# $ torchrun --standalone --nproc_per_node=8 train.py config/dar_ablations_120m.py
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/dar_ablations_120m"
arms = {
    "dar_full": {"residual": "dar", "attnres_block_size": 1},
    "dar": {"residual": "dar"},
    "dar_full_self": {"residual": "dar", "attnres_block_size": 1, "dar_keys": "self"},
    "attnres": {"residual": "attnres"},
    "hc2": {"residual": "hc", "hc_streams": 2},
    "mhc2": {"residual": "mhc", "hc_streams": 2},
}
