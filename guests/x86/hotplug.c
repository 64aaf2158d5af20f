/*
 * hotplug: stands in for the OSPM of Lucid's ACPI PCI hotplug (docs/api.md). It
 * polls the controller's registers at port 0xae00 the way the DSDT's GED _EVT
 * and PCNT read them on the GED interrupt: for each slot in UP it prints
 * "hotplug: slot N up VVVV:DDDD" (read from configuration space); for each slot
 * in DOWN it prints "hotplug: slot N down", ejects it (writes the slot's bit to
 * EJECT, as _EJ0 does) and prints "hotplug: slot N ejected vendor=VVVV" (0xffff
 * once the VMM detached the function); a power button press prints
 * "hotplug: power button". Prints "hotplug: ready" first. After `events=N`
 * handled events (default 0: never) it exits 0. With `reset=1` it resets the
 * machine through the i8042 (0xfe to port 0x64) right after "ready".
 */
#include "libcflat.h"
#include "pci.h"

#define HP_BASE 0xae00
#define HP_UP (HP_BASE + 0)
#define HP_DOWN (HP_BASE + 4)
#define HP_EJECT (HP_BASE + 8)
#define HP_EVENT (HP_BASE + 12)
#define EVENT_PCI 1
#define EVENT_POWER_BUTTON 2

int main(void)
{
	u64 want = param_u64("events", 0), handled = 0;
	printf("hotplug: ready\n");
	if (param_u64("reset", 0)) {
		printf("hotplug: reset\n");
		outb(0x64, 0xfe);
	}
	while (!want || handled < want) {
		u32 ev = inl(HP_EVENT);
		if (ev & EVENT_PCI) {
			u32 up = inl(HP_UP), down = inl(HP_DOWN);
			for (int s = 1; s < 32; s++) {
				u32 bdf = PCI_BDF(0, s, 0);
				if (up & (1u << s)) {
					printf("hotplug: slot %d up %04x:%04x\n", s,
					       pci_cfg_read16(bdf, PCI_VENDOR_ID),
					       pci_cfg_read16(bdf, PCI_DEVICE_ID));
					handled++;
				}
				if (down & (1u << s)) {
					printf("hotplug: slot %d down\n", s);
					outl(HP_EJECT, 1u << s);
					printf("hotplug: slot %d ejected vendor=%04x\n", s,
					       pci_cfg_read16(bdf, PCI_VENDOR_ID));
					handled++;
				}
			}
		}
		if (ev & EVENT_POWER_BUTTON) {
			printf("hotplug: power button\n");
			handled++;
		}
		for (int i = 0; i < 1000; i++)
			cpu_relax();
	}
	printf("hotplug: %lu events\n", handled);
	return 0;
}
