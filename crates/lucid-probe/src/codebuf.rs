//! A tiny x86-64 assembler: just the instructions the probe's guest programs need.

/// A tiny x86-64 assembler: just the instructions the probe and benchmark guests need.
#[derive(Debug, Default, Clone)]
pub struct CodeBuf {
    bytes: Vec<u8>,
}

impl CodeBuf {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Offset of the next instruction (a label for the jumps).
    pub fn here(&self) -> usize {
        self.bytes.len()
    }

    /// The encoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Appends raw bytes.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(bytes);
        self
    }

    /// `mov eax, imm32`
    pub fn mov_eax_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xb8]).raw(&imm.to_le_bytes())
    }

    /// `mov ebx, imm32` (zero-extends into rbx)
    pub fn mov_ebx_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xbb]).raw(&imm.to_le_bytes())
    }

    /// `mov ecx, imm32`
    pub fn mov_ecx_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xb9]).raw(&imm.to_le_bytes())
    }

    /// `mov ecx, [abs32]` (the address must be below 2 GiB: it is sign-extended)
    pub fn mov_ecx_from_abs(&mut self, addr: u32) -> &mut Self {
        assert!(addr < 0x8000_0000, "absolute address must be below 2 GiB");
        self.raw(&[0x8b, 0x0c, 0x25]).raw(&addr.to_le_bytes())
    }

    /// `xor ecx, ecx`
    pub fn xor_ecx_ecx(&mut self) -> &mut Self {
        self.raw(&[0x31, 0xc9])
    }

    /// `dec ecx`
    pub fn dec_ecx(&mut self) -> &mut Self {
        self.raw(&[0xff, 0xc9])
    }

    /// `mov [rbx], eax`
    pub fn store_eax_at_rbx(&mut self) -> &mut Self {
        self.raw(&[0x89, 0x03])
    }

    /// `out imm8, al`
    pub fn out_al(&mut self, port: u8) -> &mut Self {
        self.raw(&[0xe6, port])
    }

    /// `cpuid`
    pub fn cpuid(&mut self) -> &mut Self {
        self.raw(&[0x0f, 0xa2])
    }

    /// `hlt`
    pub fn hlt(&mut self) -> &mut Self {
        self.raw(&[0xf4])
    }

    /// `jnz label` (short form; the label must be within -128..127 bytes)
    pub fn jnz(&mut self, label: usize) -> &mut Self {
        let rel = self.rel8(label);
        self.raw(&[0x75, rel])
    }

    /// `jmp label` (short form)
    pub fn jmp(&mut self, label: usize) -> &mut Self {
        let rel = self.rel8(label);
        self.raw(&[0xeb, rel])
    }

    fn rel8(&self, label: usize) -> u8 {
        let next = self.bytes.len() as i64 + 2;
        let rel = label as i64 - next;
        let rel = i8::try_from(rel).expect("short jump target out of range");
        rel as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_buf_encodes_loop() {
        let mut c = CodeBuf::new();
        c.mov_ecx_imm(5);
        let top = c.here();
        c.dec_ecx().jnz(top).out_al(0x81).jmp(0);
        assert_eq!(
            c.bytes(),
            &[0xb9, 5, 0, 0, 0, 0xff, 0xc9, 0x75, 0xfc, 0xe6, 0x81, 0xeb, 0xf3]
        );
    }
}
