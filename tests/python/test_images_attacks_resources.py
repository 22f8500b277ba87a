"""The attack suite's resources and signals (test_attacks_resources.py) again, on the built
python-minimal image (images_helpers.run_attack_file_on_minimal). The image is
built once per build tree.
"""
import images_helpers as ih


def test_attacks_resources_pass_on_a_built_image():
    print(ih.run_attack_file_on_minimal("test_attacks_resources.py")[-3000:])
