"""Speed: the width chooser, the cost curves and the floor against plain decoding, and
calibration on this device."""
